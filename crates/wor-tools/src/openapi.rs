//! OpenAPI import: chosen operations of an OpenAPI 3.0 or 3.1 document as HTTP tools.
//!
//! The document is parsed into typed structs at this boundary. Each chosen operation becomes an
//! [`HttpToolConfig`]: its name from the `operationId` (in snake case), its summary and
//! description, and an input schema holding its path and query parameters and the properties
//! of its JSON request body. Local `$ref`s are inlined, at most [`MAX_SCHEMA_DEPTH`] levels deep
//! and [`MAX_SCHEMA_NODES`] schemas in all; a reference to itself is refused (it cannot be
//! inlined), and so is every remote reference: nothing is ever fetched. What an HTTP tool
//! cannot send faithfully is refused with the operation named, never dropped in silence — the
//! one exception is an optional header or cookie parameter, which the tool never sends.
//!
//! Security schemes map to the connection's sealed credentials ([`CredentialSlot`]): an
//! `apiKey` in a header is a secret header of that name; `http` `bearer`, `oauth2` and
//! `openIdConnect` are the bearer token. Keys in the query or a cookie, `http` basic and mutual
//! TLS are not supported.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use percent_encoding::percent_decode_str;
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::http_tool::{HttpToolConfig, HttpToolDefinition, MAX_HTTP_TOOLS, is_valid_tool_name};

/// The deepest a schema may nest once its references are inlined.
pub const MAX_SCHEMA_DEPTH: usize = 32;
/// The most schemas one tool's input schema may hold once its references are inlined (a few
/// references used many times each could otherwise grow it exponentially).
pub const MAX_SCHEMA_NODES: usize = 10_000;
/// The most bytes (about, as JSON) one tool's input schema may hold once its references are
/// inlined: a long description or enum copied at each use could otherwise grow it without
/// bound while the schemas stay few.
pub const MAX_SCHEMA_BYTES: usize = 2 * 1024 * 1024;
/// The most bytes (about, as JSON) the input schemas of one import may hold together.
pub const MAX_IMPORT_BYTES: usize = 16 * 1024 * 1024;
/// The most `$ref` hops from a parameter, request body or security scheme to its definition.
const MAX_OBJECT_HOPS: usize = 8;

/// A document or an operation cannot be imported.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpenApiError {
    /// The document is not OpenAPI 3.0 or 3.1, or does not have its shape.
    #[error("the document is not an openapi 3.0 or 3.1 document: {0}")]
    NotOpenApi(String),
    /// A chosen operation is not in the document.
    #[error("the document has no operation with operationId `{0}`")]
    UnknownOperation(String),
    /// Two operations share an `operationId`.
    #[error("operationId `{0}` is used by two operations")]
    DuplicateOperationId(String),
    /// An operation to import has no `operationId` to name its tool.
    #[error(
        "`{method} {path}` has no operationId, which names its tool; choose operations that have one"
    )]
    MissingOperationId {
        /// The method, upper case.
        method: String,
        /// The path.
        path: String,
    },
    /// The document holds no operation.
    #[error("the document has no operations")]
    NoOperations,
    /// An operation uses something an HTTP tool cannot send faithfully.
    #[error("operation `{operation}`: {reason}")]
    Unsupported {
        /// The `operationId`.
        operation: String,
        /// What is not supported.
        reason: String,
    },
    /// A `$ref` points outside the document.
    #[error(
        "operation `{operation}`: `$ref` `{reference}` points outside the document; remote references are never fetched"
    )]
    RemoteReference {
        /// The `operationId`.
        operation: String,
        /// The reference.
        reference: String,
    },
    /// A `$ref` does not resolve.
    #[error("operation `{operation}`: `$ref` `{reference}` does not resolve in the document")]
    UnresolvedReference {
        /// The `operationId`.
        operation: String,
        /// The reference.
        reference: String,
    },
    /// A `$ref` leads back to itself.
    #[error(
        "operation `{operation}`: `$ref` `{reference}` refers to itself ({chain}); a recursive schema cannot be inlined"
    )]
    CyclicReference {
        /// The `operationId`.
        operation: String,
        /// The reference met twice.
        reference: String,
        /// The references followed, in order.
        chain: String,
    },
    /// The inlined schema nests too deep.
    #[error(
        "operation `{operation}`: its schema nests deeper than {MAX_SCHEMA_DEPTH} levels once references are inlined"
    )]
    TooDeep {
        /// The `operationId`.
        operation: String,
    },
    /// The inlined schema is too large.
    #[error(
        "operation `{operation}`: its schema holds more than {MAX_SCHEMA_NODES} schemas once references are inlined"
    )]
    TooLarge {
        /// The `operationId`.
        operation: String,
    },
    /// The inlined schema is too many bytes.
    #[error(
        "operation `{operation}`: its schema holds more than {MAX_SCHEMA_BYTES} bytes once references are inlined"
    )]
    TooManyBytes {
        /// The `operationId`.
        operation: String,
    },
    /// More operations are chosen than a connection holds tools.
    #[error(
        "{count} operations are chosen, and an `http_api` connection holds at most {MAX_HTTP_TOOLS} tools; choose fewer"
    )]
    TooManyOperations {
        /// How many were chosen.
        count: usize,
    },
    /// The chosen operations' inlined schemas are too many bytes together.
    #[error(
        "the chosen operations' schemas hold more than {MAX_IMPORT_BYTES} bytes together once references are inlined (the limit was passed at operation `{operation}`); choose fewer"
    )]
    ImportTooLarge {
        /// The `operationId` at which the limit was passed.
        operation: String,
    },
    /// The tool name made from the `operationId` is not a valid tool name.
    #[error(
        "operation `{operation}` would be the tool `{name}`, which is not 1 to 40 of a-z, 0-9, `-` and `_` starting with a letter"
    )]
    InvalidToolName {
        /// The `operationId`.
        operation: String,
        /// The name made from it.
        name: String,
    },
    /// Two operations make the same tool name.
    #[error("operations `{first}` and `{second}` would both be the tool `{name}`")]
    ToolNameClash {
        /// One `operationId`.
        first: String,
        /// The other.
        second: String,
        /// The tool name.
        name: String,
    },
    /// A security requirement names a scheme the document does not define.
    #[error(
        "operation `{operation}`: security scheme `{scheme}` is not defined in `components.securitySchemes`"
    )]
    UnknownSecurityScheme {
        /// The `operationId`.
        operation: String,
        /// The scheme.
        scheme: String,
    },
}

/// Where a security scheme's secret goes on the connection.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum CredentialSlot {
    /// `Authorization: Bearer …`, the connection's bearer token.
    Bearer,
    /// A secret header of this (lower-case) name.
    Header(String),
}

impl fmt::Display for CredentialSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Bearer => f.write_str("the bearer token"),
            Self::Header(name) => write!(f, "header `{name}`"),
        }
    }
}

/// One imported operation.
#[derive(Debug, Clone, PartialEq)]
pub struct ImportedOperation {
    /// The `operationId` it came from.
    pub operation_id: String,
    /// The HTTP tool it becomes.
    pub tool: HttpToolConfig,
    /// Ways to authenticate, any one of which is enough: each a list of `(scheme, slot)` that
    /// must all be present. Empty when the operation needs none; an empty alternative means
    /// anonymous access is allowed.
    pub security: Vec<Vec<(String, CredentialSlot)>>,
}

/// What an import produced.
#[derive(Debug, Clone, PartialEq)]
pub struct OpenApiImport {
    /// The imported operations, in document order of their paths and methods.
    pub operations: Vec<ImportedOperation>,
    /// Every security scheme of the document that maps to a credential, by name.
    pub schemes: BTreeMap<String, CredentialSlot>,
}

impl OpenApiImport {
    /// The HTTP tools, in order.
    pub fn tools(&self) -> Vec<HttpToolConfig> {
        self.operations.iter().map(|o| o.tool.clone()).collect()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Version {
    V30,
    V31,
}

#[derive(Debug, Deserialize)]
struct Document {
    openapi: String,
    #[serde(default)]
    servers: Vec<Server>,
    #[serde(default)]
    paths: BTreeMap<String, PathItem>,
    #[serde(default)]
    components: Components,
    #[serde(default)]
    security: Option<Vec<BTreeMap<String, Vec<String>>>>,
}

#[derive(Debug, Deserialize)]
struct Server {
    url: String,
    #[serde(default)]
    variables: BTreeMap<String, ServerVariable>,
}

#[derive(Debug, Deserialize)]
struct ServerVariable {
    default: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Components {
    #[serde(default)]
    security_schemes: BTreeMap<String, Value>,
}

#[derive(Debug, Deserialize)]
struct PathItem {
    #[serde(rename = "$ref")]
    reference: Option<String>,
    #[serde(default)]
    parameters: Vec<Value>,
    get: Option<Operation>,
    put: Option<Operation>,
    post: Option<Operation>,
    delete: Option<Operation>,
    options: Option<Operation>,
    head: Option<Operation>,
    patch: Option<Operation>,
    trace: Option<Operation>,
}

impl PathItem {
    fn operations(&self) -> impl Iterator<Item = (&'static str, &Operation)> {
        [
            ("GET", &self.get),
            ("PUT", &self.put),
            ("POST", &self.post),
            ("DELETE", &self.delete),
            ("OPTIONS", &self.options),
            ("HEAD", &self.head),
            ("PATCH", &self.patch),
            ("TRACE", &self.trace),
        ]
        .into_iter()
        .filter_map(|(method, op)| op.as_ref().map(|op| (method, op)))
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Operation {
    operation_id: Option<String>,
    summary: Option<String>,
    description: Option<String>,
    #[serde(default)]
    parameters: Vec<Value>,
    request_body: Option<Value>,
    security: Option<Vec<BTreeMap<String, Vec<String>>>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum ParameterLocation {
    Path,
    Query,
    Header,
    Cookie,
}

#[derive(Debug, Deserialize)]
struct Parameter {
    name: String,
    #[serde(rename = "in")]
    location: ParameterLocation,
    description: Option<String>,
    #[serde(default)]
    required: bool,
    schema: Option<Value>,
    content: Option<Value>,
    style: Option<String>,
    explode: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct RequestBody {
    #[serde(default)]
    content: BTreeMap<String, MediaType>,
}

#[derive(Debug, Deserialize)]
struct MediaType {
    schema: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type")]
enum SecurityScheme {
    #[serde(rename = "apiKey")]
    ApiKey {
        name: String,
        #[serde(rename = "in")]
        location: String,
    },
    #[serde(rename = "http")]
    Http { scheme: String },
    #[serde(rename = "oauth2")]
    OAuth2 {},
    #[serde(rename = "openIdConnect")]
    OpenIdConnect {},
    #[serde(rename = "mutualTLS")]
    MutualTls {},
}

/// A parsed OpenAPI 3.0 or 3.1 document.
#[derive(Debug)]
pub struct OpenApiDocument {
    /// The whole document, for resolving local references.
    raw: Value,
    document: Document,
    version: Version,
}

fn invalid(error: impl fmt::Display) -> OpenApiError {
    OpenApiError::NotOpenApi(error.to_string())
}

impl OpenApiDocument {
    /// Parses a document already read as JSON (a YAML document is converted by its reader).
    pub fn from_json(raw: Value) -> Result<Self, OpenApiError> {
        if raw.get("swagger").is_some() {
            return Err(invalid(
                "it is a swagger 2.0 document; convert it to openapi 3 first",
            ));
        }
        let document: Document = Document::deserialize(&raw).map_err(invalid)?;
        let version = if document.openapi.starts_with("3.0.") {
            Version::V30
        } else if document.openapi.starts_with("3.1.") {
            Version::V31
        } else {
            return Err(invalid(format!(
                "version `{}` is not 3.0 or 3.1",
                document.openapi
            )));
        };
        Ok(Self {
            raw,
            document,
            version,
        })
    }

    /// The first server's URL with its variables set to their defaults; `None` when the
    /// document names no server.
    pub fn server_url(&self) -> Option<String> {
        let server = self.document.servers.first()?;
        let mut url = server.url.clone();
        for (name, variable) in &server.variables {
            url = url.replace(&format!("{{{name}}}"), &variable.default);
        }
        Some(url)
    }

    /// Every `operationId` in the document, in order.
    pub fn operation_ids(&self) -> Vec<String> {
        self.document
            .paths
            .values()
            .flat_map(PathItem::operations)
            .filter_map(|(_, op)| op.operation_id.clone())
            .collect()
    }

    /// Imports the operations named in `chosen` (by `operationId`), or all of them when
    /// `chosen` is empty. Any operation that cannot be imported refuses the whole import.
    pub fn import(&self, chosen: &[String]) -> Result<OpenApiImport, OpenApiError> {
        let mut seen_ids = BTreeSet::new();
        let mut found = Vec::new();
        for (path, item) in &self.document.paths {
            for (method, operation) in item.operations() {
                let Some(id) = &operation.operation_id else {
                    if chosen.is_empty() {
                        return Err(OpenApiError::MissingOperationId {
                            method: method.to_owned(),
                            path: path.clone(),
                        });
                    }
                    continue;
                };
                if !seen_ids.insert(id.clone()) {
                    return Err(OpenApiError::DuplicateOperationId(id.clone()));
                }
                if chosen.is_empty() || chosen.contains(id) {
                    found.push(ChosenOperation {
                        path,
                        item,
                        method,
                        operation,
                        id,
                    });
                }
            }
        }
        for id in chosen {
            if !seen_ids.contains(id) {
                return Err(OpenApiError::UnknownOperation(id.clone()));
            }
        }
        if found.is_empty() {
            return Err(OpenApiError::NoOperations);
        }
        // Refused before any is imported: each may hold up to its limit of schema.
        if found.len() > MAX_HTTP_TOOLS {
            return Err(OpenApiError::TooManyOperations { count: found.len() });
        }
        let schemes = self.schemes()?;
        let mut names: BTreeMap<String, String> = BTreeMap::new();
        let mut operations = Vec::new();
        let mut bytes = 0;
        for chosen in found {
            let imported = self.import_operation(&chosen, &schemes, &mut bytes)?;
            let id = chosen.id;
            if let Some(first) = names.insert(imported.tool.name.clone(), id.to_owned()) {
                return Err(OpenApiError::ToolNameClash {
                    first,
                    second: id.to_owned(),
                    name: imported.tool.name,
                });
            }
            operations.push(imported);
        }
        let schemes = schemes
            .into_iter()
            .filter_map(|(name, slot)| slot.map(|slot| (name, slot)))
            .collect();
        Ok(OpenApiImport {
            operations,
            schemes,
        })
    }

    /// Each security scheme and the slot it maps to (`None`: not supported).
    fn schemes(&self) -> Result<BTreeMap<String, Option<CredentialSlot>>, OpenApiError> {
        let mut schemes = BTreeMap::new();
        for (name, value) in &self.document.components.security_schemes {
            let context = format!("securityScheme `{name}`");
            let value = self.follow(value, &context)?;
            let scheme = SecurityScheme::deserialize(value)
                .map_err(|e| invalid(format!("{context}: {e}")))?;
            let slot = match scheme {
                SecurityScheme::ApiKey { name, location } if location == "header" => {
                    Some(CredentialSlot::Header(name.to_ascii_lowercase()))
                }
                SecurityScheme::Http { scheme } if scheme.eq_ignore_ascii_case("bearer") => {
                    Some(CredentialSlot::Bearer)
                }
                SecurityScheme::OAuth2 {} | SecurityScheme::OpenIdConnect {} => {
                    Some(CredentialSlot::Bearer)
                }
                SecurityScheme::ApiKey { .. }
                | SecurityScheme::Http { .. }
                | SecurityScheme::MutualTls {} => None,
            };
            schemes.insert(name.clone(), slot);
        }
        Ok(schemes)
    }

    /// Follows `$ref`s from a parameter, request body or security scheme to its definition.
    fn follow<'a>(
        &'a self,
        mut value: &'a Value,
        context: &str,
    ) -> Result<&'a Value, OpenApiError> {
        for _ in 0..MAX_OBJECT_HOPS {
            let Some(reference) = value.get("$ref") else {
                return Ok(value);
            };
            let reference = reference
                .as_str()
                .ok_or_else(|| invalid(format!("{context}: `$ref` is not a string")))?;
            value = resolve_local(&self.raw, reference).map_err(|remote| {
                if remote {
                    OpenApiError::RemoteReference {
                        operation: context.to_owned(),
                        reference: reference.to_owned(),
                    }
                } else {
                    OpenApiError::UnresolvedReference {
                        operation: context.to_owned(),
                        reference: reference.to_owned(),
                    }
                }
            })?;
        }
        Err(invalid(format!(
            "{context}: more than {MAX_OBJECT_HOPS} `$ref`s in a row"
        )))
    }

    fn import_operation(
        &self,
        chosen: &ChosenOperation<'_>,
        schemes: &BTreeMap<String, Option<CredentialSlot>>,
        import_bytes: &mut usize,
    ) -> Result<ImportedOperation, OpenApiError> {
        let ChosenOperation {
            path,
            item,
            method,
            operation,
            id,
        } = *chosen;
        let unsupported = |reason: String| OpenApiError::Unsupported {
            operation: id.to_owned(),
            reason,
        };
        if let Some(reference) = &item.reference {
            return Err(unsupported(format!(
                "its path item is a `$ref` (`{reference}`), which is not supported"
            )));
        }
        if !matches!(method, "GET" | "PUT" | "POST" | "DELETE" | "HEAD" | "PATCH") {
            return Err(unsupported(format!(
                "method {method} is not supported for http tools"
            )));
        }
        let name = tool_name(id);
        if !is_valid_tool_name(&name) {
            return Err(OpenApiError::InvalidToolName {
                operation: id.to_owned(),
                name,
            });
        }
        let sends_body = matches!(method, "PUT" | "POST" | "PATCH");
        let mut inliner = Inliner {
            raw: &self.raw,
            version: self.version,
            operation: id,
            nodes: 0,
            bytes: 0,
            import_bytes,
            chain: Vec::new(),
        };
        // Path-level parameters first; an operation's parameter of the same name and place
        // replaces one of them.
        let mut parameters: Vec<Parameter> = Vec::new();
        for value in item.parameters.iter().chain(&operation.parameters) {
            let value = self.follow(value, id)?;
            // A parameter may be a reference every operation uses: counted whole, before it is
            // read (a copy), whether or not the tool will send it.
            inliner.count(json_bytes(value))?;
            let parameter = Parameter::deserialize(value)
                .map_err(|e| unsupported(format!("a parameter is not valid: {e}")))?;
            parameters.retain(|p| !(p.name == parameter.name && p.location == parameter.location));
            parameters.push(parameter);
        }
        let mut properties = Map::new();
        let mut required = Vec::new();
        for parameter in parameters {
            let where_ = match parameter.location {
                ParameterLocation::Path => "path",
                ParameterLocation::Query => "query",
                ParameterLocation::Header | ParameterLocation::Cookie => {
                    if parameter.required {
                        return Err(unsupported(format!(
                            "its required {} parameter `{}` cannot be sent by an http tool",
                            if parameter.location == ParameterLocation::Header {
                                "header"
                            } else {
                                "cookie"
                            },
                            parameter.name
                        )));
                    }
                    continue;
                }
            };
            if parameter.content.is_some() {
                return Err(unsupported(format!(
                    "{where_} parameter `{}` is described by `content`, which is not supported",
                    parameter.name
                )));
            }
            if parameter.location == ParameterLocation::Path
                && !parameter
                    .name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_')
            {
                return Err(unsupported(format!(
                    "path parameter `{}` has a name of other characters than ascii letters, digits and `_`",
                    parameter.name
                )));
            }
            if parameter.location == ParameterLocation::Query && sends_body {
                return Err(unsupported(format!(
                    "query parameter `{}` on a {method}: an http tool sends a {method}'s arguments in its json body",
                    parameter.name
                )));
            }
            let mut schema = match &parameter.schema {
                Some(schema) => inliner.schema(schema, 1)?,
                None => Value::Object(Map::new()),
            };
            if parameter.location == ParameterLocation::Query {
                check_query_parameter(&parameter, &schema).map_err(unsupported)?;
            }
            if let (Some(description), Value::Object(object)) =
                (&parameter.description, &mut schema)
                && !description.is_empty()
                && !object.contains_key("description")
            {
                object.insert("description".to_owned(), Value::String(description.clone()));
            }
            if parameter.location == ParameterLocation::Path || parameter.required {
                // Written a second time, in `required`.
                inliner.count(parameter.name.len() + 4)?;
                required.push(Value::String(parameter.name.clone()));
            }
            if properties.insert(parameter.name.clone(), schema).is_some() {
                return Err(unsupported(format!(
                    "parameter `{}` appears twice (in the path and the query)",
                    parameter.name
                )));
            }
        }
        let mut additional = Some(Value::Bool(false));
        if let Some(body) = &operation.request_body {
            if !sends_body {
                return Err(unsupported(format!(
                    "a {method} with a request body: an http tool sends a {method}'s arguments in its query"
                )));
            }
            let body = self.follow(body, id)?;
            let body = RequestBody::deserialize(body)
                .map_err(|e| unsupported(format!("its request body is not valid: {e}")))?;
            let json = body.content.iter().find(|(media, _)| is_json_media(media));
            let Some((_, media)) = json else {
                let kinds: Vec<&str> = body.content.keys().map(String::as_str).collect();
                return Err(unsupported(format!(
                    "its request body is not json ({}); an http tool sends json",
                    kinds.join(", ")
                )));
            };
            let schema = match &media.schema {
                Some(schema) => inliner.schema(schema, 1)?,
                None => Value::Object(Map::new()),
            };
            additional =
                merge_body(&schema, &mut properties, &mut required).map_err(unsupported)?;
        }
        let mut input_schema = Map::new();
        input_schema.insert("type".to_owned(), Value::String("object".to_owned()));
        input_schema.insert("properties".to_owned(), Value::Object(properties));
        if !required.is_empty() {
            input_schema.insert("required".to_owned(), Value::Array(required));
        }
        if let Some(additional) = additional {
            input_schema.insert("additionalProperties".to_owned(), additional);
        }
        let description = match (&operation.summary, &operation.description) {
            (Some(s), Some(d)) if !s.is_empty() && !d.is_empty() && s.trim() != d.trim() => {
                Some(format!("{}\n\n{}", s.trim(), d.trim()))
            }
            (Some(s), _) if !s.trim().is_empty() => Some(s.trim().to_owned()),
            (_, Some(d)) if !d.trim().is_empty() => Some(d.trim().to_owned()),
            _ => None,
        };
        let tool = HttpToolConfig {
            name,
            description,
            method: method.to_owned(),
            path: path.to_owned(),
            input_schema,
        };
        HttpToolDefinition::new(tool.clone()).map_err(|e| unsupported(e.to_string()))?;
        let requirements = operation
            .security
            .as_ref()
            .or(self.document.security.as_ref());
        let security = self.security(id, requirements, schemes)?;
        Ok(ImportedOperation {
            operation_id: id.to_owned(),
            tool,
            security,
        })
    }

    /// An operation's security alternatives that an HTTP tool can meet.
    fn security(
        &self,
        id: &str,
        requirements: Option<&Vec<BTreeMap<String, Vec<String>>>>,
        schemes: &BTreeMap<String, Option<CredentialSlot>>,
    ) -> Result<Vec<Vec<(String, CredentialSlot)>>, OpenApiError> {
        let Some(requirements) = requirements.filter(|r| !r.is_empty()) else {
            return Ok(Vec::new());
        };
        let mut alternatives = Vec::new();
        let mut unsupported = BTreeSet::new();
        'alternatives: for requirement in requirements {
            let mut slots = Vec::new();
            for scheme in requirement.keys() {
                match schemes.get(scheme) {
                    None => {
                        return Err(OpenApiError::UnknownSecurityScheme {
                            operation: id.to_owned(),
                            scheme: scheme.clone(),
                        });
                    }
                    Some(None) => {
                        unsupported.insert(scheme.clone());
                        continue 'alternatives;
                    }
                    Some(Some(slot)) => slots.push((scheme.clone(), slot.clone())),
                }
            }
            alternatives.push(slots);
        }
        if alternatives.is_empty() {
            let names: Vec<String> = unsupported.iter().map(|s| format!("`{s}`")).collect();
            return Err(OpenApiError::Unsupported {
                operation: id.to_owned(),
                reason: format!(
                    "it needs security scheme {}, which an http tool cannot send (only api keys in a header, bearer tokens, oauth2 and openIdConnect access tokens)",
                    names.join(" or ")
                ),
            });
        }
        Ok(alternatives)
    }
}

/// `addPet` → `add_pet`, `get-user` → `get-user`; other characters become `_`.
pub fn tool_name(operation_id: &str) -> String {
    let mut name = String::with_capacity(operation_id.len() + 4);
    let mut previous: Option<char> = None;
    for c in operation_id.chars() {
        if c.is_ascii_uppercase() {
            if previous.is_some_and(|p| p.is_ascii_lowercase() || p.is_ascii_digit()) {
                name.push('_');
            }
            name.push(c.to_ascii_lowercase());
        } else if c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-' {
            name.push(c);
        } else {
            name.push('_');
        }
        previous = Some(c);
    }
    name
}

fn is_json_media(media: &str) -> bool {
    let essence = media.split(';').next().unwrap_or_default().trim();
    essence.eq_ignore_ascii_case("application/json") || essence.ends_with("+json")
}

/// A query parameter must be a scalar or an array of scalars sent as repeated keys (`form`,
/// exploded: OpenAPI's default).
fn check_query_parameter(parameter: &Parameter, schema: &Value) -> Result<(), String> {
    let types = schema_types(schema);
    if types.iter().any(|t| t == "object") {
        return Err(format!(
            "query parameter `{}` is an object, which an http tool cannot send",
            parameter.name
        ));
    }
    if parameter.style.as_deref().is_some_and(|s| s != "form") {
        return Err(format!(
            "query parameter `{}` has style `{}`; only `form` is supported",
            parameter.name,
            parameter.style.as_deref().unwrap_or_default()
        ));
    }
    if types.iter().any(|t| t == "array") && parameter.explode == Some(false) {
        return Err(format!(
            "query parameter `{}` is an array joined with commas (`explode: false`); only repeated keys are supported",
            parameter.name
        ));
    }
    Ok(())
}

fn schema_types(schema: &Value) -> Vec<String> {
    match schema.get("type") {
        Some(Value::String(t)) => vec![t.clone()],
        Some(Value::Array(types)) => types
            .iter()
            .filter_map(|t| t.as_str().map(str::to_owned))
            .collect(),
        _ => Vec::new(),
    }
}

/// Puts a JSON body's properties beside the parameters; returns the input schema's
/// `additionalProperties` (the body's own, as extra arguments go in the body).
fn merge_body(
    schema: &Value,
    properties: &mut Map<String, Value>,
    required: &mut Vec<Value>,
) -> Result<Option<Value>, String> {
    let Value::Object(schema) = schema else {
        return Err("its request body schema is not an object schema".to_owned());
    };
    let types = schema_types(&Value::Object(schema.clone()));
    let is_object = types == ["object"] || (types.is_empty() && schema.contains_key("properties"));
    if !is_object {
        return Err(format!(
            "its request body is {}, not an object; an http tool sends its arguments as one json object",
            if types.is_empty() {
                "not a plain object schema".to_owned()
            } else {
                format!("of type {}", types.join(" or "))
            }
        ));
    }
    for keyword in ["allOf", "anyOf", "oneOf", "not", "if", "patternProperties"] {
        if schema.contains_key(keyword) {
            return Err(format!(
                "its request body schema uses `{keyword}`, which cannot be merged with its parameters"
            ));
        }
    }
    if let Some(Value::Object(body)) = schema.get("properties") {
        for (name, property) in body {
            if properties.insert(name.clone(), property.clone()).is_some() {
                return Err(format!(
                    "body property `{name}` has the name of a parameter"
                ));
            }
        }
    }
    if let Some(Value::Array(names)) = schema.get("required") {
        required.extend(names.iter().cloned());
    }
    Ok(schema.get("additionalProperties").cloned())
}

/// Resolves a local reference (`#/components/schemas/Pet`); `Err(true)` when it is remote,
/// `Err(false)` when it does not resolve.
fn resolve_local<'a>(raw: &'a Value, reference: &str) -> Result<&'a Value, bool> {
    let Some(fragment) = reference.strip_prefix('#') else {
        return Err(true);
    };
    if !fragment.starts_with('/') {
        return Err(false);
    }
    let pointer = percent_decode_str(fragment)
        .decode_utf8()
        .map_err(|_| false)?;
    raw.pointer(&pointer).ok_or(false)
}

/// An operation chosen for import, where the document has it.
#[derive(Clone, Copy)]
struct ChosenOperation<'a> {
    path: &'a str,
    item: &'a PathItem,
    method: &'static str,
    operation: &'a Operation,
    id: &'a str,
}

/// Inlines a schema's references, bounded in depth and size.
struct Inliner<'a> {
    raw: &'a Value,
    version: Version,
    operation: &'a str,
    nodes: usize,
    /// About how many bytes the schemas inlined so far hold, as JSON ([`json_bytes`]).
    bytes: usize,
    /// The same, counted from the start of the import.
    import_bytes: &'a mut usize,
    chain: Vec<String>,
}

/// Keywords whose value is one schema.
const SCHEMA_KEYWORDS: &[&str] = &[
    "items",
    "additionalProperties",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "additionalItems",
    "contentSchema",
];
/// Keywords whose value is an array of schemas.
const SCHEMA_ARRAY_KEYWORDS: &[&str] = &["allOf", "anyOf", "oneOf", "prefixItems"];
/// Keywords whose value maps names to schemas.
const SCHEMA_MAP_KEYWORDS: &[&str] = &[
    "properties",
    "patternProperties",
    "$defs",
    "definitions",
    "dependentSchemas",
];

/// About how many bytes `value` takes written as JSON: its strings and keys, and a few bytes
/// for each other value. Iterative: the depth is serde_json's.
fn json_bytes(value: &Value) -> usize {
    let mut total = 0usize;
    let mut pending = vec![value];
    while let Some(value) = pending.pop() {
        let own = match value {
            Value::String(text) => text.len() + 2,
            Value::Array(items) => {
                pending.extend(items);
                2
            }
            Value::Object(map) => {
                pending.extend(map.values());
                map.keys().map(|key| key.len() + 4).sum::<usize>() + 2
            }
            _ => 8,
        };
        total = total.saturating_add(own);
    }
    total
}

impl Inliner<'_> {
    /// Counts `bytes` more of output: refused past [`MAX_SCHEMA_BYTES`] for the operation or
    /// [`MAX_IMPORT_BYTES`] for the import.
    fn count(&mut self, bytes: usize) -> Result<(), OpenApiError> {
        self.bytes = self.bytes.saturating_add(bytes);
        *self.import_bytes = self.import_bytes.saturating_add(bytes);
        if self.bytes > MAX_SCHEMA_BYTES {
            return Err(OpenApiError::TooManyBytes {
                operation: self.operation.to_owned(),
            });
        }
        if *self.import_bytes > MAX_IMPORT_BYTES {
            return Err(OpenApiError::ImportTooLarge {
                operation: self.operation.to_owned(),
            });
        }
        Ok(())
    }

    /// `value`, a keyword's value that is not a schema, copied into the output and counted.
    fn copied(&mut self, value: &Value) -> Result<Value, OpenApiError> {
        self.count(json_bytes(value))?;
        Ok(value.clone())
    }

    fn schema(&mut self, schema: &Value, depth: usize) -> Result<Value, OpenApiError> {
        if depth > MAX_SCHEMA_DEPTH {
            return Err(OpenApiError::TooDeep {
                operation: self.operation.to_owned(),
            });
        }
        self.nodes += 1;
        if self.nodes > MAX_SCHEMA_NODES {
            return Err(OpenApiError::TooLarge {
                operation: self.operation.to_owned(),
            });
        }
        let Value::Object(object) = schema else {
            // `true` and `false` schemas; anything else, the schema validator refuses later.
            return self.copied(schema);
        };
        if let Some(reference) = object.get("$ref") {
            let resolved = self.reference(reference, depth)?;
            if object.len() == 1 {
                return Ok(resolved);
            }
            // Keywords beside a `$ref` apply too (3.1); they stay beside it through `allOf`.
            let mut rest = object.clone();
            rest.remove("$ref");
            let mut wrapped = match self.schema(&Value::Object(rest), depth)? {
                Value::Object(wrapped) => wrapped,
                _ => Map::new(),
            };
            wrapped.insert("allOf".to_owned(), Value::Array(vec![resolved]));
            return Ok(Value::Object(wrapped));
        }
        let mut out = Map::new();
        for (key, value) in object {
            if key == "xml" || key == "externalDocs" || key.starts_with("x-") {
                continue;
            }
            let converted = if SCHEMA_KEYWORDS.contains(&key.as_str()) {
                match value {
                    // `items` as an array is the old tuple form.
                    Value::Array(items) => Value::Array(
                        items
                            .iter()
                            .map(|s| self.schema(s, depth + 1))
                            .collect::<Result<_, _>>()?,
                    ),
                    single => self.schema(single, depth + 1)?,
                }
            } else if SCHEMA_ARRAY_KEYWORDS.contains(&key.as_str()) {
                match value {
                    Value::Array(items) => Value::Array(
                        items
                            .iter()
                            .map(|s| self.schema(s, depth + 1))
                            .collect::<Result<_, _>>()?,
                    ),
                    other => self.copied(other)?,
                }
            } else if SCHEMA_MAP_KEYWORDS.contains(&key.as_str()) {
                match value {
                    Value::Object(map) => Value::Object(
                        map.iter()
                            .map(|(name, s)| {
                                self.count(name.len() + 4)?;
                                Ok((name.clone(), self.schema(s, depth + 1)?))
                            })
                            .collect::<Result<_, OpenApiError>>()?,
                    ),
                    other => self.copied(other)?,
                }
            } else {
                self.copied(value)?
            };
            self.count(key.len() + 4)?;
            out.insert(key.clone(), converted);
        }
        if self.version == Version::V30 {
            convert_30(&mut out);
        }
        Ok(Value::Object(out))
    }

    fn reference(&mut self, reference: &Value, depth: usize) -> Result<Value, OpenApiError> {
        let Value::String(reference) = reference else {
            return Err(OpenApiError::Unsupported {
                operation: self.operation.to_owned(),
                reason: "a `$ref` is not a string".to_owned(),
            });
        };
        if self.chain.contains(reference) {
            let mut chain = self.chain.clone();
            chain.push(reference.clone());
            return Err(OpenApiError::CyclicReference {
                operation: self.operation.to_owned(),
                reference: reference.clone(),
                chain: chain.join(" -> "),
            });
        }
        let target = resolve_local(self.raw, reference).map_err(|remote| {
            if remote {
                OpenApiError::RemoteReference {
                    operation: self.operation.to_owned(),
                    reference: reference.clone(),
                }
            } else {
                OpenApiError::UnresolvedReference {
                    operation: self.operation.to_owned(),
                    reference: reference.clone(),
                }
            }
        })?;
        self.chain.push(reference.clone());
        let resolved = self.schema(target, depth + 1);
        self.chain.pop();
        resolved
    }
}

/// OpenAPI 3.0's schema dialect in JSON Schema terms: `nullable` becomes a `null` type, and
/// boolean `exclusiveMinimum`/`exclusiveMaximum` become numbers.
fn convert_30(schema: &mut Map<String, Value>) {
    if schema.remove("nullable") == Some(Value::Bool(true)) {
        match schema.get_mut("type") {
            Some(Value::String(t)) => {
                let t = std::mem::take(t);
                schema.insert(
                    "type".to_owned(),
                    Value::Array(vec![Value::String(t), Value::String("null".to_owned())]),
                );
            }
            Some(Value::Array(types)) if !types.iter().any(|t| t == "null") => {
                types.push(Value::String("null".to_owned()));
            }
            _ => {}
        }
        if let Some(Value::Array(values)) = schema.get_mut("enum")
            && !values.contains(&Value::Null)
        {
            values.push(Value::Null);
        }
    }
    for (exclusive, bound) in [
        ("exclusiveMinimum", "minimum"),
        ("exclusiveMaximum", "maximum"),
    ] {
        if let Some(Value::Bool(flag)) = schema.get(exclusive).cloned() {
            schema.remove(exclusive);
            if flag && let Some(limit) = schema.remove(bound) {
                schema.insert(exclusive.to_owned(), limit);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn document(paths: Value, components: Value) -> OpenApiDocument {
        OpenApiDocument::from_json(json!({
            "openapi": "3.0.3",
            "info": {"title": "t", "version": "1"},
            "paths": paths,
            "components": components,
        }))
        .unwrap()
    }

    fn one(doc: &OpenApiDocument) -> Result<ImportedOperation, OpenApiError> {
        doc.import(&[]).map(|i| i.operations[0].clone())
    }

    #[test]
    fn names_are_snake_case_of_the_operation_id() {
        assert_eq!(tool_name("addPet"), "add_pet");
        assert_eq!(tool_name("findPetsByStatus"), "find_pets_by_status");
        assert_eq!(tool_name("get-user.v2"), "get-user_v2");
        assert_eq!(tool_name("list2Things"), "list2_things");
    }

    #[test]
    fn local_references_are_inlined_and_3_0_nullable_becomes_a_null_type() {
        let doc = document(
            json!({"/things/{id}": {"put": {"operationId": "putThing",
                "parameters": [{"$ref": "#/components/parameters/Id"}],
                "requestBody": {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Thing"}}}}}}}),
            json!({
                "parameters": {"Id": {"name": "id", "in": "path", "required": true, "schema": {"type": "integer"}}},
                "schemas": {
                    "Thing": {"type": "object", "required": ["label"], "xml": {"name": "t"}, "x-internal": 1,
                        "properties": {"label": {"type": "string", "nullable": true},
                                       "xml": {"$ref": "#/components/schemas/Part"},
                                       "size": {"type": "number", "minimum": 0, "exclusiveMinimum": true}}},
                    "Part": {"type": "string", "enum": ["a"]}
                }
            }),
        );
        let op = one(&doc).unwrap();
        assert_eq!(op.tool.name, "put_thing");
        assert_eq!(
            Value::Object(op.tool.input_schema),
            json!({"type": "object", "required": ["id", "label"],
            "properties": {
                "id": {"type": "integer"},
                "label": {"type": ["string", "null"]},
                "xml": {"type": "string", "enum": ["a"]},
                "size": {"type": "number", "exclusiveMinimum": 0}
            }})
        );
    }

    #[test]
    fn cycles_remote_references_and_depth_are_refused() {
        let body = |schema: &str| {
            json!({"/a": {"post": {"operationId": "a",
                "requestBody": {"content": {"application/json": {"schema": {"$ref": schema}}}}}}})
        };
        let cyclic = document(
            body("#/components/schemas/Node"),
            json!({"schemas": {"Node": {"type": "object", "properties": {"next": {"$ref": "#/components/schemas/Node"}}}}}),
        );
        assert!(matches!(
            one(&cyclic),
            Err(OpenApiError::CyclicReference { ref chain, .. }) if chain.contains("Node -> #/components/schemas/Node")
        ));
        let remote = document(body("https://example.com/schemas.json#/Pet"), json!({}));
        assert!(matches!(
            one(&remote),
            Err(OpenApiError::RemoteReference { .. })
        ));
        let other_file = document(body("other.yaml#/Pet"), json!({}));
        assert!(matches!(
            one(&other_file),
            Err(OpenApiError::RemoteReference { .. })
        ));
        let missing = document(body("#/components/schemas/Nope"), json!({}));
        assert!(matches!(
            one(&missing),
            Err(OpenApiError::UnresolvedReference { .. })
        ));
        let mut deep = json!({"type": "string"});
        for _ in 0..40 {
            deep = json!({"type": "object", "properties": {"x": deep}});
        }
        let deep = document(
            body("#/components/schemas/Deep"),
            json!({"schemas": {"Deep": deep}}),
        );
        assert!(matches!(one(&deep), Err(OpenApiError::TooDeep { .. })));
        // Each level used four times: 4^10 schemas once inlined, only 21 levels deep.
        let mut schemas = Map::new();
        for level in 0..10 {
            let next = json!({"$ref": format!("#/components/schemas/L{}", level + 1)});
            schemas.insert(
                format!("L{level}"),
                json!({"type": "object", "properties": {
                    "a": next, "b": next, "c": next, "d": next}}),
            );
        }
        schemas.insert("L10".to_owned(), json!({"type": "string"}));
        let wide = document(body("#/components/schemas/L0"), json!({"schemas": schemas}));
        assert!(matches!(one(&wide), Err(OpenApiError::TooLarge { .. })));
    }

    /// A long description copied at each use of its schema: few schemas, many bytes. One
    /// operation past its limit is refused, and so are operations each within theirs whose
    /// schemas together pass the import's.
    #[test]
    fn a_schema_copied_into_many_bytes_is_refused() {
        let long = |bytes: usize| json!({"schemas": {"Long": {"type": "string", "description": "d".repeat(bytes)}}});
        let uses = |count: usize| {
            let properties: Map<String, Value> = (0..count)
                .map(|i| {
                    (
                        format!("p{i}"),
                        json!({"$ref": "#/components/schemas/Long"}),
                    )
                })
                .collect();
            json!({"type": "object", "properties": properties})
        };
        let operation = |id: String, schema: Value| {
            json!({"post": {"operationId": id,
                "requestBody": {"content": {"application/json": {"schema": schema}}}}})
        };
        // 64 KiB used 40 times: 2.5 MiB from 41 schemas.
        let many = document(
            json!({"/a": operation("a".to_owned(), uses(40))}),
            long(64 * 1024),
        );
        assert!(matches!(
            one(&many),
            Err(OpenApiError::TooManyBytes { ref operation }) if operation == "a"
        ));
        // 30 times is within one operation's limit ...
        let fewer = document(
            json!({"/a": operation("a".to_owned(), uses(30))}),
            long(64 * 1024),
        );
        assert!(one(&fewer).is_ok());
        // ... and 9 such operations pass the import's.
        let paths: Map<String, Value> = (0..9)
            .map(|i| (format!("/op{i}"), operation(format!("op{i}"), uses(30))))
            .collect();
        let together = document(Value::Object(paths), long(64 * 1024));
        assert!(matches!(
            together.import(&[]),
            Err(OpenApiError::ImportTooLarge { ref operation }) if operation == "op8"
        ));
        assert!(
            together
                .import(&["op0".to_owned(), "op1".to_owned()])
                .is_ok()
        );
        // A parameter, a reference every operation uses, is counted too: its description, and
        // even a header parameter the tool never sends.
        let used_by_twelve = |parameter: Value| {
            let paths: Map<String, Value> = (0..12)
                .map(|i| {
                    (
                        format!("/get{i:02}"),
                        json!({"get": {"operationId": format!("get{i:02}"),
                            "parameters": [{"$ref": "#/components/parameters/P"}]}}),
                    )
                })
                .collect();
            document(
                Value::Object(paths),
                json!({"parameters": {"P": parameter}}),
            )
        };
        for place in ["query", "header"] {
            let parameter = json!({"name": "p", "in": place,
                "description": "d".repeat(1536 * 1024), "schema": {"type": "string"}});
            assert!(
                matches!(
                    used_by_twelve(parameter).import(&[]),
                    Err(OpenApiError::ImportTooLarge { ref operation }) if operation == "get10"
                ),
                "a {place} parameter"
            );
        }
        // More operations than a connection holds tools are refused before any is imported.
        let paths: Map<String, Value> = (0..=MAX_HTTP_TOOLS)
            .map(|i| {
                (
                    format!("/t{i}"),
                    json!({"get": {"operationId": format!("t{i}")}}),
                )
            })
            .collect();
        let many = document(Value::Object(paths), json!({}));
        assert!(matches!(
            many.import(&[]),
            Err(OpenApiError::TooManyOperations { count }) if count == MAX_HTTP_TOOLS + 1
        ));
    }

    #[test]
    fn what_an_http_tool_cannot_send_is_refused_by_operation() {
        for (operation, why) in [
            (
                json!({"post": {"operationId": "x", "parameters": [{"name": "q", "in": "query", "schema": {"type": "string"}}]}}),
                "query parameter `q` on a POST",
            ),
            (
                json!({"get": {"operationId": "x", "parameters": [{"name": "h", "in": "header", "required": true, "schema": {"type": "string"}}]}}),
                "required header parameter `h`",
            ),
            (
                json!({"post": {"operationId": "x", "requestBody": {"content": {"application/octet-stream": {"schema": {"type": "string"}}}}}}),
                "not json (application/octet-stream)",
            ),
            (
                json!({"post": {"operationId": "x", "requestBody": {"content": {"application/json": {"schema": {"type": "array"}}}}}}),
                "of type array",
            ),
            (
                json!({"get": {"operationId": "x", "parameters": [{"name": "f", "in": "query", "schema": {"type": "object"}}]}}),
                "is an object",
            ),
            (
                json!({"get": {"operationId": "x", "parameters": [{"name": "t", "in": "query", "explode": false, "schema": {"type": "array"}}]}}),
                "joined with commas",
            ),
            (
                json!({"get": {"operationId": "x", "security": [{"basic": []}]}}),
                "security scheme `basic`",
            ),
        ] {
            let doc = document(
                json!({"/p": operation}),
                json!({"securitySchemes": {"basic": {"type": "http", "scheme": "basic"}}}),
            );
            let error = one(&doc).unwrap_err().to_string();
            assert!(error.contains(why), "{why}: {error}");
            assert!(error.starts_with("operation `x`: "), "{error}");
        }
    }

    #[test]
    fn security_schemes_map_to_credential_slots() {
        let doc = document(
            json!({"/p": {"get": {"operationId": "x", "security": [{"basic": []}, {"key": [], "oauth": ["read"]}, {}]}}}),
            json!({"securitySchemes": {
                "basic": {"type": "http", "scheme": "basic"},
                "key": {"type": "apiKey", "in": "header", "name": "X-Api-Key"},
                "oauth": {"type": "oauth2", "flows": {}}}}),
        );
        let import = doc.import(&["x".to_owned()]).unwrap();
        assert_eq!(
            import.operations[0].security,
            vec![
                vec![
                    (
                        "key".to_owned(),
                        CredentialSlot::Header("x-api-key".to_owned())
                    ),
                    ("oauth".to_owned(), CredentialSlot::Bearer)
                ],
                vec![]
            ]
        );
        assert_eq!(import.schemes.len(), 2);
    }

    #[test]
    fn chosen_operations_must_exist_and_swagger_2_is_named() {
        let doc = document(json!({"/p": {"get": {"operationId": "x"}}}), json!({}));
        assert_eq!(
            doc.import(&["y".to_owned()]).unwrap_err(),
            OpenApiError::UnknownOperation("y".to_owned())
        );
        let error = OpenApiDocument::from_json(json!({"swagger": "2.0", "paths": {}})).unwrap_err();
        assert!(error.to_string().contains("swagger 2.0"), "{error}");
        let error = OpenApiDocument::from_json(json!({"openapi": "4.0.0"})).unwrap_err();
        assert!(error.to_string().contains("`4.0.0`"), "{error}");
    }
}
