//! The book's identity-provider recipes (docs/src/access-control.md,
//! "Keycloak" and "Auth0"), each run as written: a token of exactly the
//! shape the provider issues, RS256, its key served by a local JWKS
//! endpoint as the provider's certs URL would, checked against the
//! recipe's `[auth]` and a resource whose rows belong to a tenant claim.
//! Then what each common mistake is answered with: the cause named in the
//! JSON error (`reason`) and the fix in its message, never the token.

use crate::common;
use crate::support;

use bloomgate::auth::jwt::Alg;
use common::*;
use serde_json::{Value, json};
use support::*;

/// Orders of two tenants: 1 and 3 are `acme`'s, 2 is `beta`'s.
async fn orders() -> TestDb {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE orders (id bigint PRIMARY KEY, tenant text NOT NULL, total int NOT NULL);
         INSERT INTO orders VALUES (1, 'acme', 10), (2, 'beta', 20), (3, 'acme', 30)",
    )
    .await;
    db
}

/// The recipe's `[auth]` (its `jwks_url` the local endpoint) and the
/// orders resource, readable with `scope` by the owner named in
/// `owner_claim`.
fn recipe(db: &TestDb, auth: &str, scope: &str, owner_claim: &str) -> bloomgate::config::Config {
    config(
        &db.url,
        &format!(
            "[auth]\n{auth}\n\
             [[resource]]\nname = \"orders\"\nroute = \"/orders/{{id}}\"\ntable = \"orders\"\n\
             key_column = \"id\"\nkey_type = \"bigint\"\ncolumns = [\"id\", \"tenant\", \"total\"]\n\
             auth = \"jwt\"\nscopes = [{scope:?}]\nowner_claim = {owner_claim:?}\n\
             owner_column = \"tenant\"\n"
        ),
    )
}

/// The error body of a refusal: status, `reason`, `message`.
async fn refusal(r: reqwest::Response) -> (u16, String, String) {
    let status = r.status().as_u16();
    let body: Value = r.json().await.unwrap();
    (
        status,
        body["reason"].as_str().unwrap_or_default().to_string(),
        body["message"].as_str().unwrap_or_default().to_string(),
    )
}

/// Keycloak: realm `shop`, its certs URL, the audience from an Audience
/// mapper, realm roles as scopes (`/realm_access/roles`), the tenant from
/// a user-attribute mapper.
#[tokio::test]
async fn a_keycloak_token_reads_its_tenants_rows_with_the_books_recipe() {
    let db = orders().await;
    let keys = Signers::new();
    let jwks = JwksServer::start(&json!({"keys": [keys.jwk(Alg::RS256, "kc-rs256")]})).await;
    const ISS: &str = "https://kc.example.com/realms/shop";
    let cfg = recipe(
        &db,
        &format!(
            "jwks_url = \"{}\"   # https://kc.example.com/realms/shop/protocol/openid-connect/certs\n\
             issuer = \"{ISS}\"\naudience = \"bloomgate\"\nscope_claim = \"/realm_access/roles\"",
            jwks.url
        ),
        "orders:read",
        "tenant",
    );
    let gw = gateway(cfg);
    let served = serve_socket(&gw, None).await;
    let c = Client::new(served.addr);
    // An access token as Keycloak 26 issues it, the mappers applied.
    let t = now();
    let token = |claims: &Value| keys.sign(Alg::RS256, Some("kc-rs256"), claims);
    let keycloak = json!({
        "exp": t + 300, "iat": t, "auth_time": t - 5,
        "jti": "onrtac:8f0c6b1e-6a7d-4c8e-9a57-3d2f1b0e4c11",
        "iss": ISS,
        "aud": ["bloomgate", "account"],
        "sub": "f6b4c2c8-3a1e-4c5b-9f0e-2b7d1e0c9a41",
        "typ": "Bearer",
        "azp": "shop-web",
        "sid": "2c1f0b9e-7d6a-4e5f-8a3b-1c2d3e4f5a6b",
        "acr": "1",
        "allowed-origins": ["https://app.example.com"],
        "realm_access": {"roles": ["offline_access", "default-roles-shop", "orders:read", "uma_authorization"]},
        "resource_access": {"account": {"roles": ["manage-account", "view-profile"]}},
        "scope": "openid email profile",
        "email_verified": true,
        "preferred_username": "alice",
        "tenant": "acme"
    });
    let r = c.bearer("/orders/1", &token(&keycloak)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["tenant"], "acme");
    assert_eq!(c.bearer("/orders/3", &token(&keycloak)).await.status(), 200);
    // Another tenant's order reads as an absent one.
    assert_eq!(c.bearer("/orders/2", &token(&keycloak)).await.status(), 404);

    // Without the Audience mapper: Keycloak's default aud, "account".
    let mut unmapped = keycloak.clone();
    unmapped["aud"] = json!("account");
    let (status, reason, message) = refusal(c.bearer("/orders/1", &token(&unmapped)).await).await;
    assert_eq!((status, reason.as_str()), (401, "audience"));
    for says in [
        "\"account\"",
        "auth.audience",
        "\"bloomgate\"",
        "Audience mapper",
    ] {
        assert!(message.contains(says), "{says}: {message}");
    }
    // Without the realm role: the missing scope, and where it is read.
    let mut no_role = keycloak.clone();
    no_role["realm_access"]["roles"] = json!(["offline_access", "uma_authorization"]);
    let (status, reason, message) = refusal(c.bearer("/orders/1", &token(&no_role)).await).await;
    assert_eq!((status, reason.as_str()), (403, "insufficient_scope"));
    assert!(
        message.contains("\"orders:read\"") && message.contains("/realm_access/roles"),
        "{message}"
    );
    // A multivalued attribute mapper: the tenant comes as an array, and
    // each of its tenants' rows is the caller's.
    let mut multivalued = keycloak.clone();
    multivalued["tenant"] = json!(["acme"]);
    assert_eq!(
        c.bearer("/orders/1", &token(&multivalued)).await.status(),
        200
    );
    assert_eq!(
        c.bearer("/orders/2", &token(&multivalued)).await.status(),
        404
    );
    // A tenant that is an object names no owner: the claim is named, and
    // what it holds; no scope is.
    let mut object = keycloak.clone();
    object["tenant"] = json!({"name": "acme"});
    let r = c.bearer("/orders/1", &token(&object)).await;
    assert_eq!(
        h(&r, "www-authenticate"),
        "Bearer realm=\"bloomgate\", error=\"insufficient_scope\""
    );
    let (status, reason, message) = refusal(r).await;
    assert_eq!((status, reason.as_str()), (403, "owner_claim_type"));
    assert!(
        message.contains("\"tenant\"") && message.contains("an object, {\"name\":\"acme\"}"),
        "{message}"
    );
    assert!(!message.contains("scope"), "{message}");
    // Expired, by how long.
    let mut expired = keycloak.clone();
    expired["exp"] = json!(t - 7200);
    let (status, reason, message) = refusal(c.bearer("/orders/1", &token(&expired)).await).await;
    assert_eq!((status, reason.as_str()), (401, "expired"));
    assert!(message.contains("expired 2h"), "{message}");
    // A key of another realm: its kid is named.
    let other_realm = keys.sign(Alg::RS256, Some("other-realm-key"), &keycloak);
    let (status, reason, message) = refusal(c.bearer("/orders/1", &other_realm).await).await;
    assert_eq!((status, reason.as_str()), (401, "unknown_key"));
    assert!(
        message.contains("\"other-realm-key\"") && message.contains("auth.jwks_url"),
        "{message}"
    );
    assert!(
        !message.contains(&other_realm[..30]),
        "the token was quoted"
    );
    served.shutdown().await.unwrap();
}

/// Auth0: the tenant's issuer (with its trailing slash), the API's
/// identifier as the audience, RBAC permissions as scopes
/// (`permissions`), the tenant in a namespaced claim an Action adds.
#[tokio::test]
async fn an_auth0_token_reads_its_tenants_rows_with_the_books_recipe() {
    let db = orders().await;
    let keys = Signers::new();
    let jwks = JwksServer::start(&json!({"keys": [keys.jwk(Alg::RS256, "auth0-key-1")]})).await;
    const ISS: &str = "https://shop.eu.auth0.com/";
    const API: &str = "https://api.shop.example";
    let cfg = recipe(
        &db,
        &format!(
            "jwks_url = \"{}\"   # https://shop.eu.auth0.com/.well-known/jwks.json\n\
             issuer = \"{ISS}\"\naudience = \"{API}\"\nscope_claim = \"permissions\"",
            jwks.url
        ),
        "read:orders",
        "https://shop.example/tenant",
    );
    let gw = gateway(cfg);
    let served = serve_socket(&gw, None).await;
    let c = Client::new(served.addr);
    // An access token as Auth0 issues it for an API with RBAC and "Add
    // Permissions in the Access Token" on, an Action adding the tenant.
    let t = now();
    let token = |claims: &Value| keys.sign(Alg::RS256, Some("auth0-key-1"), claims);
    let auth0 = json!({
        "https://shop.example/tenant": "acme",
        "iss": ISS,
        "sub": "auth0|64f1c2a9e4b0c1a2b3c4d5e6",
        "aud": [API, "https://shop.eu.auth0.com/userinfo"],
        "iat": t,
        "exp": t + 86400,
        "scope": "openid profile email",
        "azp": "AbCdEf0123456789GhIjKl",
        "permissions": ["read:orders"]
    });
    let r = c.bearer("/orders/3", &token(&auth0)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["total"], 30);
    assert_eq!(c.bearer("/orders/2", &token(&auth0)).await.status(), 404);

    // The issuer without its trailing slash: said.
    let mut slashless = auth0.clone();
    slashless["iss"] = json!("https://shop.eu.auth0.com");
    let (status, reason, message) = refusal(c.bearer("/orders/1", &token(&slashless)).await).await;
    assert_eq!((status, reason.as_str()), (401, "issuer"));
    assert!(message.contains("trailing slash"), "{message}");
    // An ID token sent by mistake: its aud is the client's id, and it has
    // no permissions.
    let mut id_token = auth0.clone();
    id_token["aud"] = json!("AbCdEf0123456789GhIjKl");
    let (status, reason, message) = refusal(c.bearer("/orders/1", &token(&id_token)).await).await;
    assert_eq!((status, reason.as_str()), (401, "audience"));
    assert!(
        message.contains("\"AbCdEf0123456789GhIjKl\"") && message.contains("audience parameter"),
        "{message}"
    );
    // No aud at all.
    let mut no_aud = auth0.clone();
    no_aud.as_object_mut().unwrap().remove("aud");
    let (status, reason, _) = refusal(c.bearer("/orders/1", &token(&no_aud)).await).await;
    assert_eq!((status, reason.as_str()), (401, "no_audience"));
    // RBAC on without the permission: named.
    let mut unpermitted = auth0.clone();
    unpermitted["permissions"] = json!([]);
    let (status, reason, message) =
        refusal(c.bearer("/orders/1", &token(&unpermitted)).await).await;
    assert_eq!((status, reason.as_str()), (403, "insufficient_scope"));
    assert!(
        message.contains("\"read:orders\"") && message.contains("\"permissions\""),
        "{message}"
    );
    // No tenant claim (the Action did not run): the claim is named.
    let mut untenanted = auth0.clone();
    untenanted
        .as_object_mut()
        .unwrap()
        .remove("https://shop.example/tenant");
    let (status, reason, message) = refusal(c.bearer("/orders/1", &token(&untenanted)).await).await;
    assert_eq!((status, reason.as_str()), (403, "no_owner_claim"));
    assert!(
        message.contains("\"https://shop.example/tenant\""),
        "{message}"
    );
    // Counted by reason, as the access line and the JSON say them.
    let v = gw.auth.view();
    for reason in [
        "issuer",
        "audience",
        "no_audience",
        "insufficient_scope",
        "no_owner_claim",
    ] {
        assert_eq!(v.failures[reason], 1, "{reason}: {:?}", v.failures);
    }
    served.shutdown().await.unwrap();
}
