//! OpenAPI import against a real public document: the Swagger Petstore's (Apache-2.0,
//! `testdata/openapi/petstore.yaml`, source in `testdata/SOURCES.md`).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::http::{HeaderMap, Method, Uri};
use secrecy::SecretString;
use serde_json::{Map, Value, json};
use wor_tools::{
    ConnectionCredentials, CredentialSlot, HttpApiConnection, HttpToolDefinition, OpenApiDocument,
    OpenApiError, ToolListVerdict, compare, pin_all,
};

use crate::{allow, loopback_egress, serve};

const PETSTORE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../testdata/openapi/petstore.yaml"
));

/// Every Petstore operation an HTTP tool can send faithfully.
const IMPORTABLE: &[&str] = &[
    "addPet",
    "updatePet",
    "findPetsByStatus",
    "findPetsByTags",
    "getPetById",
    "deletePet",
    "getInventory",
    "placeOrder",
    "getOrderById",
    "deleteOrder",
    "createUser",
    "loginUser",
    "logoutUser",
    "getUserByName",
    "deleteUser",
];

fn petstore_json() -> Value {
    serde_norway::from_str(PETSTORE).unwrap()
}

fn petstore() -> OpenApiDocument {
    OpenApiDocument::from_json(petstore_json()).unwrap()
}

fn chosen() -> Vec<String> {
    IMPORTABLE.iter().map(|s| (*s).to_owned()).collect()
}

fn resolve<'a>(doc: &'a Value, schema: &'a Value) -> &'a Value {
    match schema.get("$ref").and_then(Value::as_str) {
        Some(reference) => resolve(doc, doc.pointer(&reference[1..]).unwrap()),
        None => schema,
    }
}

/// The examples the document gives for `schema`, by JSON path below it: every `example`
/// (and `examples[0]`) of a property, recursively.
fn documented_examples(doc: &Value, schema: &Value, path: &str, out: &mut Vec<(String, Value)>) {
    let schema = resolve(doc, schema);
    if let Some(example) = schema
        .get("example")
        .or_else(|| schema.pointer("/examples/0"))
    {
        out.push((path.to_owned(), example.clone()));
    }
    if let Some(properties) = schema.get("properties").and_then(Value::as_object) {
        for (name, property) in properties {
            documented_examples(doc, property, &format!("{path}/{name}"), out);
        }
    }
}

/// A value of `schema`'s type built from its documented examples, with a stand-in of the
/// right type where the document gives none.
fn example_value(doc: &Value, schema: &Value) -> Value {
    let schema = resolve(doc, schema);
    if let Some(example) = schema.get("example") {
        return example.clone();
    }
    if let Some(first) = schema.pointer("/enum/0") {
        return first.clone();
    }
    match schema.get("type").and_then(Value::as_str) {
        Some("object") => {
            let mut object = Map::new();
            for (name, property) in schema["properties"].as_object().into_iter().flatten() {
                object.insert(name.clone(), example_value(doc, property));
            }
            Value::Object(object)
        }
        Some("array") => json!([example_value(doc, &schema["items"])]),
        Some("integer") => json!(3),
        Some("number") => json!(1.5),
        Some("boolean") => json!(true),
        _ => json!("text"),
    }
}

/// The operation's arguments as the documented examples give them: parameters and the
/// properties of its JSON body.
fn operation_example(doc: &Value, operation: &Value) -> (Map<String, Value>, Vec<(String, Value)>) {
    let mut arguments = Map::new();
    let mut documented = Vec::new();
    for parameter in operation["parameters"].as_array().into_iter().flatten() {
        if !matches!(parameter["in"].as_str(), Some("path" | "query")) {
            continue;
        }
        let name = parameter["name"].as_str().unwrap();
        if let Some(example) = parameter.get("example") {
            documented.push((format!("/{name}"), example.clone()));
        }
        documented_examples(
            doc,
            &parameter["schema"],
            &format!("/{name}"),
            &mut documented,
        );
        arguments.insert(
            name.to_owned(),
            parameter
                .get("example")
                .cloned()
                .unwrap_or_else(|| example_value(doc, &parameter["schema"])),
        );
    }
    if let Some(schema) = operation.pointer("/requestBody/content/application~1json/schema") {
        documented_examples(doc, schema, "", &mut documented);
        if let Value::Object(body) = example_value(doc, schema) {
            arguments.extend(body);
        }
    }
    (arguments, documented)
}

fn operations_by_id(doc: &Value) -> Map<String, Value> {
    let mut operations = Map::new();
    for item in doc["paths"].as_object().unwrap().values() {
        for operation in item.as_object().unwrap().values() {
            if let Some(id) = operation.get("operationId").and_then(Value::as_str) {
                operations.insert(id.to_owned(), operation.clone());
            }
        }
    }
    operations
}

fn sub_schema<'a>(schema: &'a Value, path: &str) -> &'a Value {
    let mut current = schema;
    for name in path.split('/').skip(1) {
        current = &current["properties"][name];
    }
    current
}

#[test]
fn the_petstore_imports_as_tools_whose_schemas_accept_its_documented_examples() {
    let raw = petstore_json();
    let import = petstore().import(&chosen()).unwrap();
    assert_eq!(import.operations.len(), IMPORTABLE.len());
    let operations = operations_by_id(&raw);
    let mut documented_checked = 0;
    for imported in &import.operations {
        let tool = &imported.tool;
        let schema = Value::Object(tool.input_schema.clone());
        let validator = jsonschema::validator_for(&schema).unwrap();
        let operation = &operations[&imported.operation_id];
        let (arguments, documented) = operation_example(&raw, operation);
        let arguments = Value::Object(arguments);
        let errors: Vec<String> = validator
            .iter_errors(&arguments)
            .map(|e| e.to_string())
            .collect();
        assert!(
            errors.is_empty(),
            "{}: the documented example {arguments} does not validate: {errors:?}",
            tool.name
        );
        for (path, example) in documented {
            let property = sub_schema(&schema, &path);
            assert!(property.is_object(), "{}: no property at {path}", tool.name);
            let validator = jsonschema::validator_for(property).unwrap();
            assert!(
                validator.is_valid(&example),
                "{}: the example {example} at {path} does not validate against {property}",
                tool.name
            );
            // The schema is not vacuous: a value of another type is refused.
            let wrong = if example.is_string() {
                json!({"not": "a string"})
            } else {
                json!("not a number")
            };
            assert!(
                !validator.is_valid(&wrong),
                "{}: {path} accepts {wrong}",
                tool.name
            );
            documented_checked += 1;
        }
    }
    // Pet (with Category) twice, Order and User carry 20 examples over the bodies imported.
    assert!(
        documented_checked >= 20,
        "only {documented_checked} examples"
    );
    let get_pet = import
        .operations
        .iter()
        .find(|o| o.operation_id == "getPetById")
        .unwrap();
    assert_eq!(get_pet.tool.name, "get_pet_by_id");
    assert_eq!(get_pet.tool.method, "GET");
    assert_eq!(get_pet.tool.path, "/pet/{petId}");
    assert_eq!(
        get_pet.tool.description.as_deref(),
        Some("Find pet by ID.\n\nReturns a single pet.")
    );
    assert_eq!(
        Value::Object(get_pet.tool.input_schema.clone()),
        json!({"type": "object", "additionalProperties": false, "required": ["petId"],
            "properties": {"petId": {"type": "integer", "format": "int64",
                "description": "ID of pet to return"}}})
    );
    // Either the api key header or the oauth2 token is enough for it.
    assert_eq!(
        get_pet.security,
        vec![
            vec![(
                "api_key".to_owned(),
                CredentialSlot::Header("api_key".to_owned())
            )],
            vec![("petstore_auth".to_owned(), CredentialSlot::Bearer)],
        ]
    );
    let add_pet = import
        .operations
        .iter()
        .find(|o| o.operation_id == "addPet")
        .unwrap();
    // The body's `Pet` with its `Category` and `Tag` inlined; no `$ref`, `xml` or extension left.
    let text = serde_json::to_string(&add_pet.tool.input_schema).unwrap();
    for gone in ["$ref", "\"xml\"", "x-swagger"] {
        assert!(!text.contains(gone), "{gone} left in {text}");
    }
    assert_eq!(
        add_pet.tool.input_schema["required"],
        json!(["name", "photoUrls"])
    );
    assert_eq!(
        add_pet.tool.input_schema["properties"]["category"]["properties"]["name"],
        json!({"type": "string", "example": "Dogs"})
    );
}

#[test]
fn what_the_petstore_holds_that_a_tool_cannot_send_is_refused_by_name() {
    let error = petstore().import(&[]).unwrap_err();
    assert!(
        matches!(&error, OpenApiError::Unsupported { operation, reason }
            if operation == "updatePetWithForm" && reason.contains("query parameter `name` on a POST")),
        "{error}"
    );
    for (operation, why) in [
        (
            "uploadFile",
            "query parameter `additionalMetadata` on a POST",
        ),
        ("createUsersWithListInput", "of type array"),
        // `PUT /user/{username}` whose `User` body has a `username` too: one argument cannot
        // be both.
        (
            "updateUser",
            "body property `username` has the name of a parameter",
        ),
    ] {
        let error = petstore().import(&[operation.to_owned()]).unwrap_err();
        assert!(error.to_string().contains(why), "{operation}: {error}");
    }
}

#[test]
fn importing_twice_pins_the_same_and_a_changed_operation_is_a_quarantine() {
    let tools = |doc: &OpenApiDocument| -> Vec<wor_tools::ToolDefinition> {
        doc.import(&chosen())
            .unwrap()
            .tools()
            .into_iter()
            .map(|config| HttpToolDefinition::new(config).unwrap().tool_definition())
            .collect()
    };
    let pins = pin_all(tools(&petstore()));
    assert_eq!(
        compare(&pins, &tools(&petstore())).verdict(),
        ToolListVerdict::Unchanged
    );
    // The publisher widens `petId` to a string and renames a query parameter.
    let mut changed = petstore_json();
    changed["paths"]["/pet/{petId}"]["get"]["parameters"][0]["schema"] = json!({"type": "string"});
    changed["paths"]["/user/login"]["get"]["parameters"][1]["name"] = json!("passphrase");
    let changed = OpenApiDocument::from_json(changed).unwrap();
    let diff = compare(&pins, &tools(&changed));
    assert_eq!(diff.verdict(), ToolListVerdict::Quarantine);
    let names: Vec<&str> = diff.changed.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["get_pet_by_id", "login_user"]);
    let text = diff.to_string();
    assert!(
        text.contains("inputSchema/properties/petId/type: \"integer\" -> \"string\""),
        "{text}"
    );
}

#[derive(Debug, Clone)]
struct Seen {
    method: Method,
    uri: String,
    api_key: Option<String>,
    body: String,
}

async fn recording_server() -> (SocketAddr, Arc<Mutex<Vec<Seen>>>) {
    let log: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let record = Arc::clone(&log);
    let router = axum::Router::new().fallback(
        move |method: Method, uri: Uri, headers: HeaderMap, body: Bytes| {
            let record = Arc::clone(&record);
            async move {
                record.lock().unwrap().push(Seen {
                    method,
                    uri: uri.to_string(),
                    api_key: headers
                        .get("api_key")
                        .map(|v| v.to_str().unwrap().to_owned()),
                    body: String::from_utf8_lossy(&body).into_owned(),
                });
                axum::Json(json!({"id": 10, "name": "doggie"}))
            }
        },
    );
    (serve(router).await, log)
}

#[tokio::test]
async fn imported_tools_send_their_requests_where_the_document_says() {
    let (addr, log) = recording_server().await;
    let connection = HttpApiConnection::new(
        &format!("http://{addr}/v3"),
        allow(addr),
        ConnectionCredentials::none()
            .with_header("api_key", SecretString::from("special-key"))
            .unwrap(),
    )
    .unwrap();
    let import = petstore().import(&chosen()).unwrap();
    let tool = |id: &str| {
        let config = import
            .operations
            .iter()
            .find(|o| o.operation_id == id)
            .unwrap()
            .tool
            .clone();
        HttpToolDefinition::new(config).unwrap()
    };
    let egress = loopback_egress();
    let call = |id: &str, arguments: Value| {
        let tool = tool(id);
        let egress = egress.clone();
        let connection = connection.clone();
        async move {
            tool.execute(&egress, &connection, arguments.as_object().unwrap())
                .await
                .unwrap()
        }
    };
    assert!(!call("getPetById", json!({"petId": 10})).await.is_error);
    call("findPetsByTags", json!({"tags": ["tag1", "tag 2"]})).await;
    call(
        "addPet",
        json!({"name": "doggie", "photoUrls": [], "category": {"id": 1, "name": "Dogs"}}),
    )
    .await;
    let seen = log.lock().unwrap().clone();
    assert_eq!(seen[0].method, Method::GET);
    assert_eq!(seen[0].uri, "/v3/pet/10");
    assert_eq!(seen[0].api_key.as_deref(), Some("special-key"));
    assert_eq!(seen[1].uri, "/v3/pet/findByTags?tags=tag1&tags=tag%202");
    assert_eq!(seen[2].method, Method::POST);
    assert_eq!(seen[2].uri, "/v3/pet");
    assert_eq!(
        serde_json::from_str::<Value>(&seen[2].body).unwrap(),
        json!({"name": "doggie", "photoUrls": [], "category": {"id": 1, "name": "Dogs"}})
    );
}
