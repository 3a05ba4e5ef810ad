//! The OpenAPI documents: the public one at `/openapi.json` on the public
//! listener, the admin one at `/admin/openapi.json` on the admin listener
//! (behind the token). Each lists only what its listener serves.
//!
//! Static routes carry their own `#[utoipa::path]` entries, collected by
//! the routers that serve them; resource routes come from the config, so
//! their entries are generated here from the same config the router uses.
//! A row's properties are typed from the database's catalog (the column's
//! type, domains resolved, nullability), as the JSON that `row_to_json`
//! emits for that type: a client generated from the document parses what
//! the gateway sends. Until the catalog has been read (the database not
//! reachable yet) the public document types the columns as "any value" and
//! is rebuilt on the next request.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use serde::Serialize;
use utoipa::ToSchema;
use utoipa::openapi::header::HeaderBuilder;
use utoipa::openapi::path::{HttpMethod, OperationBuilder, ParameterBuilder, ParameterIn};
use utoipa::openapi::schema::{ArrayBuilder, Schema, SchemaType};
use utoipa::openapi::security::{
    ApiKey, ApiKeyValue, Http, HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme,
};
use utoipa::openapi::{
    ContentBuilder, InfoBuilder, KnownFormat, LicenseBuilder, ObjectBuilder, OpenApi, Ref,
    Required, ResponseBuilder, SchemaFormat, Type,
};

use crate::config::AuthMode;
use crate::db::catalog::{self, ColumnInfo};
use crate::gateway::Gateway;
use crate::key::KeyType;

/// `{"status": ...}` of the health endpoints.
#[derive(Serialize, ToSchema)]
pub struct StatusBody {
    /// `ok`, `ready`, `starting` (a filter is still loading) or `not_ready`.
    pub status: String,
    /// Resources whose filters are still loading (503 only).
    pub loading: Option<Vec<String>>,
    /// What each resource not ready waits for, by name, `change_feed` for
    /// the feed's own reason and `auth` for the access checks' (503 only).
    pub reasons: Option<std::collections::BTreeMap<String, String>>,
}

/// Every error: a stable code and a message safe to show.
#[derive(Serialize, ToSchema)]
pub struct ErrorBody {
    /// `malformed_key`, `not_found`, `not_ready`, `database_unavailable`,
    /// `overloaded`, `timeout`, `unauthorized`, ...
    pub error: String,
    /// A refused credential's cause (401, 403, and the 400
    /// `invalid_request`): `missing`, `expired`, `audience`,
    /// `no_audience`, `unknown_key`, `insufficient_scope`,
    /// `no_owner_claim`, `owner_claim_type`, ... (the `reason` label of
    /// `bloomgate_auth_failures_total`). Absent on other errors.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The cause in words and, where there is one, the fix (a token's
    /// `aud` and the audience expected, how long ago it expired); never
    /// the credential.
    pub message: String,
}

/// Each resource's columns as the catalog describes them, by resource
/// name; a resource missing from the map is typed loosely.
pub type Columns = HashMap<String, Vec<ColumnInfo>>;

/// Reads every resource's column types. A resource whose table is gone is
/// left out (start-up reports it).
pub async fn read_columns(gw: &Gateway) -> Result<Columns, sqlx::Error> {
    let mut out = Columns::new();
    for r in &gw.resources {
        if let Some(info) = catalog::table_info(gw.db.pool(), &r.config.table).await? {
            out.insert(r.name().to_string(), info.columns);
        }
    }
    Ok(out)
}

/// `info` for both documents: this project's, never utoipa's defaults.
fn info(title: &str, description: &str) -> utoipa::openapi::Info {
    InfoBuilder::new()
        .title(title)
        .version(env!("CARGO_PKG_VERSION"))
        .description(Some(description))
        .license(Some(
            LicenseBuilder::new()
                .name(env!("CARGO_PKG_LICENSE"))
                .identifier(Some(env!("CARGO_PKG_LICENSE")))
                .build(),
        ))
        .build()
}

/// The public document: health, `/openapi.json` and one path per resource.
pub fn public_document(public: OpenApi, gw: &Gateway, columns: &Columns) -> OpenApi {
    let mut doc = public;
    let mut about = String::from(
        "Lookups by key in front of PostgreSQL, with a filter that answers 404 for keys \
         that do not exist without touching the database. Every lookup response carries \
         an RFC 9211 `Cache-Status` header and a `Cache-Control` for caches in front of \
         the gateway.",
    );
    let cors = &gw.config.server.cors;
    if cors.enabled() {
        about.push_str(&format!(
            " Pages of {} may read every answer (CORS: a preflight `OPTIONS` is answered 204 \
             before any credential is asked for; answers carry `Access-Control-Allow-Origin`, \
             `Access-Control-Expose-Headers` and, for every origin, `Vary: Origin`).",
            match cors.any_origin() {
                true => "any origin".to_string(),
                false => cors.allow_origins.join(", "),
            }
        ));
    }
    doc.info = info("bloomgate", &about);
    doc.paths.add_path_operation(
        "/openapi.json",
        vec![HttpMethod::Get],
        this_document("health", "openapi"),
    );
    for r in &gw.resources {
        add_resource(
            &mut doc,
            r,
            gw.config.server.max_key_length,
            columns.get(r.name()).map(Vec::as_slice),
            cors.enabled(),
        );
    }
    add_security_schemes(&mut doc, gw);
    add_bodies(&mut doc);
    doc
}

/// The schemes the resources use: `bearerAuth` (a JWT in `Authorization`)
/// and `apiKey` (`X-API-Key`).
fn add_security_schemes(doc: &mut OpenApi, gw: &Gateway) {
    let modes: Vec<AuthMode> = gw.resources.iter().map(|r| r.config.access.mode).collect();
    let components = doc.components.get_or_insert_with(Default::default);
    if modes.iter().any(|m| m.takes_jwt()) {
        components.add_security_scheme(
            "bearerAuth",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format("JWT")
                    .description(Some(
                        "A JWT signed with `auth.jwt_secret` (HS256/384/512) or a key of \
                         `auth.jwks_file` / `auth.jwks_url` (RS*, PS*, ES256, ES384, EdDSA); \
                         `exp` required, scopes in `auth.scope_claim`",
                    ))
                    .build(),
            ),
        );
    }
    if modes.iter().any(|m| m.takes_api_key()) {
        components.add_security_scheme(
            "apiKey",
            SecurityScheme::ApiKey(ApiKey::Header(ApiKeyValue::with_description(
                "X-API-Key",
                "A key of `auth.api_keys_file`",
            ))),
        );
    }
}

/// The operation that serves a document itself.
fn this_document(tag: &str, id: &str) -> OperationBuilder {
    OperationBuilder::new()
        .tag(tag)
        .operation_id(Some(id))
        .summary(Some("This document"))
        .response(
            "200",
            ResponseBuilder::new()
                .description("OpenAPI 3.1 JSON")
                .content("application/json", ContentBuilder::new().build()),
        )
}

/// The admin document, from the admin routes' own (`doc`): each operation
/// requires the bearer token.
pub fn admin_document(mut doc: OpenApi) -> OpenApi {
    doc.info = info(
        "bloomgate admin",
        "The admin listener: metrics, resource state, cache purges and rebuilds. Every \
         operation needs `Authorization: Bearer <admin token>`.",
    );
    doc.paths.add_path_operation(
        "/admin/openapi.json",
        vec![HttpMethod::Get],
        this_document("admin", "admin_openapi").response(
            "401",
            ResponseBuilder::new()
                .description("Missing or wrong token")
                .content("application/json", error_body()),
        ),
    );
    for item in doc.paths.paths.values_mut() {
        for op in [
            &mut item.get,
            &mut item.post,
            &mut item.delete,
            &mut item.put,
            &mut item.patch,
        ]
        .into_iter()
        .flatten()
        {
            op.security = Some(vec![SecurityRequirement::new(
                "bearer",
                Vec::<String>::new(),
            )]);
        }
    }
    let components = doc.components.get_or_insert_with(Default::default);
    components.add_security_scheme(
        "bearer",
        SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)),
    );
    add_bodies(&mut doc);
    doc
}

fn add_bodies(doc: &mut OpenApi) {
    let components = doc.components.get_or_insert_with(Default::default);
    for (name, schema) in [
        ("ErrorBody", <ErrorBody as utoipa::PartialSchema>::schema()),
        (
            "StatusBody",
            <StatusBody as utoipa::PartialSchema>::schema(),
        ),
    ] {
        components.schemas.insert(name.into(), schema);
    }
}

/// The public document as served: built with the column types once they
/// could be read, rebuilt on each request until then.
pub struct Served {
    routes: OpenApi,
    gw: Arc<Gateway>,
    typed: tokio::sync::OnceCell<Bytes>,
}

impl Served {
    pub fn new(routes: OpenApi, gw: Arc<Gateway>) -> Self {
        Self {
            routes,
            gw,
            typed: tokio::sync::OnceCell::new(),
        }
    }

    pub async fn json(&self) -> Bytes {
        if let Some(b) = self.typed.get() {
            return b.clone();
        }
        let read =
            tokio::time::timeout(std::time::Duration::from_secs(2), read_columns(&self.gw)).await;
        match read {
            Ok(Ok(columns)) => {
                let doc = to_json(&public_document(self.routes.clone(), &self.gw, &columns));
                self.typed.get_or_init(|| async { doc }).await.clone()
            }
            _ => to_json(&public_document(
                self.routes.clone(),
                &self.gw,
                &Columns::new(),
            )),
        }
    }
}

pub fn to_json(doc: &OpenApi) -> Bytes {
    Bytes::from(doc.to_json().unwrap_or_default())
}

/// The JSON a column's values become in a row (`row_to_json`), as a schema.
pub fn column_schema(c: &ColumnInfo) -> Schema {
    let mut s = match c.element.as_deref() {
        Some(element) => Schema::Array(
            ArrayBuilder::new()
                .items(base_schema(element, &c.declared).build())
                .description(Some(format!("`{}`", c.declared)))
                .build(),
        ),
        None => Schema::Object(
            base_schema(&c.base, &c.declared)
                .description(Some(format!("`{}`", c.declared)))
                .build(),
        ),
    };
    if !c.not_null {
        match &mut s {
            Schema::Object(o) => o.schema_type = nullable(o.schema_type.clone()),
            Schema::Array(a) => a.schema_type = nullable(a.schema_type.clone()),
            _ => {}
        }
    }
    s
}

/// A JSON error body (`ErrorBody`), what every error response carries.
fn error_body() -> utoipa::openapi::Content {
    ContentBuilder::new()
        .schema(Some(Ref::from_schema_name("ErrorBody")))
        .build()
}

fn nullable(t: SchemaType) -> SchemaType {
    match t {
        SchemaType::Type(t) => SchemaType::Array(vec![t, Type::Null]),
        SchemaType::Array(mut v) => {
            if !v.contains(&Type::Null) {
                v.push(Type::Null);
            }
            SchemaType::Array(v)
        }
        SchemaType::AnyValue => SchemaType::AnyValue,
    }
}

/// By the base type's `typname`, what `to_json` emits for it.
fn base_schema(typname: &str, declared: &str) -> ObjectBuilder {
    let o = ObjectBuilder::new();
    let known = |f: KnownFormat| Some(SchemaFormat::KnownFormat(f));
    let custom = |f: &str| Some(SchemaFormat::Custom(f.into()));
    match typname {
        "int2" | "int4" => o
            .schema_type(Type::Integer)
            .format(known(KnownFormat::Int32)),
        "int8" => o
            .schema_type(Type::Integer)
            .format(known(KnownFormat::Int64)),
        "oid" => o
            .schema_type(Type::Integer)
            .format(known(KnownFormat::Int64)),
        // Finite values are JSON numbers; `NaN` and the infinities are sent
        // as the strings Postgres spells them with.
        "float4" | "float8" | "numeric" => {
            o.schema_type(SchemaType::Array(vec![Type::Number, Type::String]))
        }
        "bool" => o.schema_type(Type::Boolean),
        "uuid" => o.schema_type(Type::String).format(custom("uuid")),
        "timestamptz" => o
            .schema_type(Type::String)
            .format(known(KnownFormat::DateTime)),
        // No offset: not an RFC 3339 date-time.
        "timestamp" => o
            .schema_type(Type::String)
            .format(custom("local-date-time")),
        "date" => o.schema_type(Type::String).format(known(KnownFormat::Date)),
        "time" => o.schema_type(Type::String).format(custom("local-time")),
        "timetz" => o.schema_type(Type::String).format(custom("time")),
        "bytea" => o
            .schema_type(Type::String)
            .pattern(Some("^\\\\x([0-9a-f]{2})*$")),
        "json" | "jsonb" => o.schema_type(SchemaType::AnyValue),
        "text" | "varchar" | "bpchar" | "char" | "name" | "citext" | "interval" | "inet"
        | "cidr" | "macaddr" | "money" | "xml" | "tsvector" | "bit" | "varbit" => {
            o.schema_type(Type::String)
        }
        _ => {
            // Enums are strings; anything else, whatever its output is.
            let _ = declared;
            o.schema_type(SchemaType::AnyValue)
        }
    }
}

/// `cors`: `[server.cors]` is on (every answer varies by `Origin`).
/// What `key::parse` accepts for a key (part) of type `ty`.
fn key_schema(ty: KeyType, max_key_length: usize) -> ObjectBuilder {
    match ty {
        KeyType::Bigint => ObjectBuilder::new()
            .schema_type(Type::Integer)
            .format(Some(SchemaFormat::KnownFormat(KnownFormat::Int64)))
            .pattern(Some("^-?[0-9]+$"))
            .max_length(Some(20)),
        KeyType::Uuid => ObjectBuilder::new()
            .schema_type(Type::String)
            .format(Some(SchemaFormat::Custom("uuid".into())))
            .pattern(Some(
                "^([0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}|[0-9a-fA-F]{32})$",
            ))
            .max_length(Some(36)),
        KeyType::Text => ObjectBuilder::new()
            .schema_type(Type::String)
            .description(Some(format!(
                "At most {max_key_length} bytes once percent-decoded; no control characters"
            )))
            .pattern(Some("^[^\\u0000-\\u001f\\u007f]+$"))
            .min_length(Some(1))
            .max_length(Some(max_key_length)),
    }
}

fn add_resource(
    doc: &mut OpenApi,
    r: &crate::resource::Resource,
    max_key_length: usize,
    columns: Option<&[ColumnInfo]>,
    cors: bool,
) {
    let cfg = &r.config;
    // Each key part's parameter, named as in the route, with what
    // `key::parse` accepts, so a client knows before it asks.
    let params: Vec<(String, ObjectBuilder)> = match cfg.key.as_slice() {
        [one] => vec![(
            cfg.route
                .split('/')
                .find_map(|s| s.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
                .unwrap_or("key")
                .to_string(),
            key_schema(one.ty, max_key_length),
        )],
        parts => parts
            .iter()
            .map(|p| (p.column.clone(), key_schema(p.ty, max_key_length)))
            .collect(),
    };
    let mut row = ObjectBuilder::new()
        .schema_type(Type::Object)
        .additional_properties(Some(
            utoipa::openapi::schema::AdditionalProperties::FreeForm(false),
        ));
    for c in &cfg.columns {
        let info = columns.and_then(|cols| cols.iter().find(|i| &i.name == c));
        let schema = match info {
            Some(i) => column_schema(i),
            None => Schema::Object(
                ObjectBuilder::new()
                    .schema_type(SchemaType::AnyValue)
                    .description(Some("type not read from the database yet"))
                    .build(),
            ),
        };
        row = row.property(c, schema).required(c);
    }
    let header = |d: &str| {
        HeaderBuilder::new()
            .schema(Some(ObjectBuilder::new().schema_type(Type::String).build()))
            .description(Some(d))
            .build()
    };
    let cache_status = || header("RFC 9211: which step answered (filter, cache, database)");
    let error = |d: &str| {
        ResponseBuilder::new()
            .description(d)
            .header("Cache-Status", cache_status())
            .header("Cache-Control", header("`no-store`"))
            .content("application/json", error_body())
    };
    let unavailable =
        |d: &str| error(d).header("Retry-After", header("Seconds to wait before trying again"));
    let access = &cfg.access;
    let private = access.mode != AuthMode::None;
    let vary = match (cors, cfg.cache.enabled && cfg.cache.compression) {
        (true, true) => "`Accept-Encoding, Origin`",
        (true, false) => "`Origin`",
        (false, true) => "`Accept-Encoding`",
        (false, false) => "absent (compression is off)",
    };
    let row_cache_control = match private {
        true => "`private, ` and `cache.http_cache_control`: the caller's own",
        false => "`cache.http_cache_control`",
    };
    let mut op = OperationBuilder::new()
        .tag(cfg.name.clone())
        .operation_id(Some(format!("get_{}", cfg.name)))
        .summary(Some(format!(
            "One row of `{}` by `{}`",
            cfg.table,
            cfg.key_columns().join("`, `")
        )))
        .parameters(Some(params.into_iter().map(|(name, schema)| {
            ParameterBuilder::new()
                .name(name)
                .parameter_in(ParameterIn::Path)
                .required(Required::True)
                .schema(Some(schema))
                .build()
        })))
        .response(
            "200",
            ResponseBuilder::new()
                .description("The row as a JSON object")
                .header(
                    "ETag",
                    header("Strong validator of this representation (one per coding)"),
                )
                .header(
                    "Content-Encoding",
                    header("gzip, br or zstd, as `Accept-Encoding` prefers; absent for identity"),
                )
                .header("Vary", header(vary))
                .header("Cache-Status", cache_status())
                .header("Cache-Control", header(row_cache_control))
                .content(
                    "application/json",
                    ContentBuilder::new().schema(Some(row)).build(),
                ),
        )
        .response(
            "304",
            ResponseBuilder::new()
                .description("If-None-Match matched the ETag")
                .header("ETag", header("The row's ETag"))
                .header("Cache-Status", cache_status())
                .header("Cache-Control", header(row_cache_control)),
        )
        .response(
            "400",
            error(match private {
                true => "Malformed key (whoever asks), or a bearer token and an API key at once",
                false => "Malformed key",
            }),
        )
        .response(
            "412",
            error("If-Match did not match the row's current ETag (which this response carries)")
                .header("ETag", header("The row's current ETag")),
        )
        .response(
            "404",
            error(match access.owner_claim {
                Some(_) => "No such row, or another owner's: the two read alike",
                None => "No such row (the filter or the database said so)",
            })
            .header(
                "Cache-Control",
                header("`cache.http_cache_control_not_found`"),
            ),
        )
        .response(
            "405",
            ResponseBuilder::new()
                .description(match cors {
                    true => {
                        "Only GET and HEAD (a preflight `OPTIONS` from a listed origin is answered \
                         204 instead)"
                    }
                    false => "Only GET and HEAD",
                })
                .header("Allow", header("The methods this route takes"))
                .content("application/json", error_body()),
        )
        .response(
            "413",
            ResponseBuilder::new()
                .description("A declared body over `server.max_body_bytes`")
                .content("application/json", error_body()),
        )
        .response(
            "431",
            ResponseBuilder::new()
                .description("Request head over `server.max_header_bytes` or `max_headers`"),
        )
        .response(
            "503",
            unavailable("Not ready, database unavailable or overloaded"),
        )
        .response("504", error("Request timed out"));
    if private {
        let challenge = || {
            header(
                "RFC 6750 challenge: `Bearer realm=...` and/or `ApiKey realm=..., header=\"X-API-Key\"`, with `error=` when a credential was refused",
            )
        };
        op = op
            .response(
                "401",
                error("No credential, or one that does not verify (malformed, expired, wrong signature, unknown key, wrong issuer or audience): `reason` names which, `message` what the token holds and the fix")
                    .header("WWW-Authenticate", challenge()),
            )
            .response(
                "403",
                error("The credential lacks a required scope (`reason`: `insufficient_scope`), or its owner claim is missing or names no owner (`no_owner_claim`, `owner_claim_type`)")
                    .header("WWW-Authenticate", challenge()),
            );
        let scopes = access.scopes.clone();
        let mut security = Vec::new();
        if access.mode.takes_jwt() {
            security.push(SecurityRequirement::new("bearerAuth", scopes.clone()));
        }
        if access.mode.takes_api_key() {
            security.push(SecurityRequirement::new("apiKey", scopes));
        }
        op = op.securities(Some(security));
    }
    if let Some(limit) = &access.rate_limit {
        op = op.response(
            "429",
            error(&format!(
                "Past this caller's rate limit ({} requests a second, {} at once)",
                limit.per_second, limit.burst
            ))
            .header("Retry-After", header("Seconds to wait"))
            .header(
                "RateLimit-Policy",
                header("draft-ietf-httpapi-ratelimit-headers: `\"name\";q=burst;w=seconds`"),
            )
            .header(
                "RateLimit",
                header("draft-ietf-httpapi-ratelimit-headers: `\"name\";r=0;t=seconds`"),
            ),
        );
    }
    doc.paths
        .add_path_operation(&cfg.route, vec![HttpMethod::Get, HttpMethod::Head], op);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn col(base: &str, element: Option<&str>, not_null: bool) -> ColumnInfo {
        ColumnInfo {
            name: "c".into(),
            declared: base.into(),
            base: base.into(),
            element: element.map(Into::into),
            not_null,
            collation: 0,
            base_sql: base.into(),
        }
    }

    fn json(s: Schema) -> serde_json::Value {
        serde_json::to_value(s).unwrap()
    }

    #[test]
    fn columns_are_typed_as_row_to_json_emits_them() {
        let t = |base, nn| json(column_schema(&col(base, None, nn)))["type"].clone();
        assert_eq!(t("int8", true), "integer");
        assert_eq!(t("int4", false), serde_json::json!(["integer", "null"]));
        assert_eq!(t("bool", true), "boolean");
        assert_eq!(t("text", true), "string");
        assert_eq!(t("bpchar", true), "string");
        assert_eq!(t("numeric", true), serde_json::json!(["number", "string"]));
        assert_eq!(
            t("numeric", false),
            serde_json::json!(["number", "string", "null"])
        );
        let f = |base| json(column_schema(&col(base, None, true)))["format"].clone();
        assert_eq!(f("uuid"), "uuid");
        assert_eq!(f("timestamptz"), "date-time");
        assert_eq!(f("date"), "date");
        assert_eq!(f("int8"), "int64");
        // json and jsonb: any value, so no "type" at all.
        assert!(
            json(column_schema(&col("jsonb", None, true)))
                .get("type")
                .is_none()
        );
        let a = json(column_schema(&col("_int4", Some("int4"), false)));
        assert_eq!(a["type"], serde_json::json!(["array", "null"]));
        assert_eq!(a["items"]["type"], "integer");
    }
}
