//! The OpenAPI document served at `/openapi.json`.
//!
//! Static routes carry their own `#[utoipa::path]` entries, collected by
//! the routers that serve them; resource routes come from the config, so
//! their entries are generated here from the same config the router uses.

use serde::Serialize;
use utoipa::ToSchema;
use utoipa::openapi::path::{HttpMethod, OperationBuilder, ParameterBuilder, ParameterIn};
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::openapi::{
    ContentBuilder, KnownFormat, ObjectBuilder, OpenApi, Ref, Required, ResponseBuilder,
    SchemaFormat, Type,
};

use crate::gateway::Gateway;
use crate::key::KeyType;

/// `{"status": ...}` of the health endpoints.
#[derive(Serialize, ToSchema)]
pub struct StatusBody {
    /// `ok`, `ready` or `starting`.
    pub status: String,
    /// Resources whose filters are still loading (503 only).
    pub loading: Option<Vec<String>>,
}

/// Every error: a stable code and a message safe to show.
#[derive(Serialize, ToSchema)]
pub struct ErrorBody {
    /// `malformed_key`, `not_found`, `not_ready`, `database_unavailable`,
    /// `overloaded`, `timeout`, `unauthorized`, ...
    pub error: String,
    pub message: String,
}

/// The public routes' document (`public`), plus `/openapi.json`, one path
/// per resource and the admin API.
pub fn document(public: OpenApi, gw: &Gateway) -> OpenApi {
    let mut doc = public;
    doc.info.title = "bloomgate".into();
    doc.info.version = env!("CARGO_PKG_VERSION").into();
    doc.info.description = Some(
        "Lookups by key in front of PostgreSQL. Every response carries an RFC 9211 \
         `Cache-Status` header. The admin paths are served on the admin listener \
         (`admin.listen`) only, with a bearer token."
            .into(),
    );
    doc.paths.add_path_operation(
        "/openapi.json",
        vec![HttpMethod::Get],
        OperationBuilder::new()
            .tag("health")
            .operation_id(Some("openapi"))
            .summary(Some("This document"))
            .response(
                "200",
                ResponseBuilder::new().description("OpenAPI 3.1 JSON"),
            ),
    );
    for r in &gw.resources {
        add_resource(&mut doc, r);
    }
    let (_, admin) = super::admin::routes().split_for_parts();
    doc.merge(admin);
    let components = doc.components.get_or_insert_with(Default::default);
    components.add_security_scheme(
        "bearer",
        SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)),
    );
    for (name, schema) in [
        ("ErrorBody", <ErrorBody as utoipa::PartialSchema>::schema()),
        (
            "StatusBody",
            <StatusBody as utoipa::PartialSchema>::schema(),
        ),
    ] {
        components.schemas.insert(name.into(), schema);
    }
    doc
}

fn add_resource(doc: &mut OpenApi, r: &crate::resource::Resource) {
    let cfg = &r.config;
    let param = cfg
        .route
        .split('/')
        .find_map(|s| s.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
        .unwrap_or("key");
    let key_schema = match cfg.key_type {
        KeyType::Bigint => ObjectBuilder::new()
            .schema_type(Type::Integer)
            .format(Some(SchemaFormat::KnownFormat(KnownFormat::Int64))),
        KeyType::Uuid => ObjectBuilder::new()
            .schema_type(Type::String)
            .format(Some(SchemaFormat::Custom("uuid".into()))),
        KeyType::Text => ObjectBuilder::new().schema_type(Type::String),
    };
    let mut row = ObjectBuilder::new().schema_type(Type::Object);
    for c in &cfg.columns {
        row = row.property(c, ObjectBuilder::new());
    }
    let error = |d: &str| {
        ResponseBuilder::new().description(d).content(
            "application/json",
            ContentBuilder::new()
                .schema(Some(Ref::from_schema_name("ErrorBody")))
                .build(),
        )
    };
    let op = OperationBuilder::new()
        .tag(cfg.name.clone())
        .operation_id(Some(format!("get_{}", cfg.name)))
        .summary(Some(format!(
            "One row of `{}` by `{}`",
            cfg.table, cfg.key_column
        )))
        .parameter(
            ParameterBuilder::new()
                .name(param)
                .parameter_in(ParameterIn::Path)
                .required(Required::True)
                .schema(Some(key_schema)),
        )
        .response(
            "200",
            ResponseBuilder::new()
                .description("The row as a JSON object, with an ETag")
                .content(
                    "application/json",
                    ContentBuilder::new().schema(Some(row)).build(),
                ),
        )
        .response(
            "304",
            ResponseBuilder::new().description("If-None-Match matched the ETag"),
        )
        .response("400", error("Malformed key"))
        .response(
            "404",
            error("No such row (the filter or the database said so)"),
        )
        .response(
            "503",
            error("Not ready, database unavailable or overloaded; see Retry-After"),
        )
        .response("504", error("Request timed out"));
    doc.paths
        .add_path_operation(&cfg.route, vec![HttpMethod::Get, HttpMethod::Head], op);
}
