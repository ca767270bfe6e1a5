//! The probe tool: each tool tries one thing a Wasm tool might do, and reports what happened.

use std::io::{Read, Write};

use serde_json::{Value, json};
use wasip2::http::outgoing_handler;
use wasip2::http::types::{Fields, Method, OutgoingBody, OutgoingRequest, Scheme};

wit_bindgen::generate!({
    path: "../wit/tool.wit",
    world: "tool",
});

struct Probe;

fn tool(name: &str, description: &str, properties: Value) -> Value {
    json!({
        "name": name,
        "description": description,
        "input_schema": {"type": "object", "properties": properties},
    })
}

impl Guest for Probe {
    fn list_tools() -> String {
        json!([
            tool(
                "echo",
                "Returns its text",
                json!({"text": {"type": "string"}})
            ),
            tool(
                "env",
                "Reads an environment variable",
                json!({"name": {"type": "string"}})
            ),
            tool(
                "read_file",
                "Reads a file",
                json!({"path": {"type": "string"}})
            ),
            tool(
                "write_file",
                "Writes a file",
                json!({"path": {"type": "string"}})
            ),
            tool("spin", "Computes forever", json!({})),
            tool(
                "hog",
                "Allocates and touches memory",
                json!({"mib": {"type": "integer"}})
            ),
            tool(
                "connect",
                "Opens a TCP connection",
                json!({"addr": {"type": "string"}})
            ),
            tool(
                "fetch",
                "GETs a URL over wasi-http",
                json!({"url": {"type": "string"}})
            ),
            tool(
                "upload",
                "POSTs MiB of zeros to a URL over wasi-http",
                json!({"url": {"type": "string"}, "mib": {"type": "integer"}})
            ),
        ])
        .to_string()
    }

    fn call_tool(name: String, arguments: String) -> Result<String, String> {
        let args: Value = serde_json::from_str(&arguments).map_err(|e| e.to_string())?;
        let text = |key: &str| {
            args.get(key)
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_owned()
        };
        match name.as_str() {
            "echo" => Ok(text("text")),
            "env" => std::env::var(text("name")).map_err(|e| e.to_string()),
            "read_file" => std::fs::read_to_string(text("path")).map_err(|e| e.to_string()),
            "write_file" => std::fs::write(text("path"), b"written")
                .map(|()| "written".to_owned())
                .map_err(|e| e.to_string()),
            "spin" => {
                let mut n: u64 = 0;
                loop {
                    n = std::hint::black_box(n.wrapping_add(1));
                }
            }
            "hog" => {
                let mib = args.get("mib").and_then(Value::as_u64).unwrap_or(1) as usize;
                let mut block = vec![0u8; mib << 20];
                for i in (0..block.len()).step_by(4096) {
                    block[i] = 1;
                }
                Ok(format!("{} bytes", std::hint::black_box(block).len()))
            }
            "connect" => std::net::TcpStream::connect(text("addr"))
                .map(|_| "connected".to_owned())
                .map_err(|e| e.to_string()),
            "fetch" => request(&text("url"), None),
            "upload" => {
                let mib = args.get("mib").and_then(Value::as_u64).unwrap_or(1) as usize;
                request(&text("url"), Some(mib << 20))
            }
            other => Err(format!("no tool `{other}`")),
        }
    }
}

/// A GET of `url` (`http://` or `https://`), or a POST of `upload` zero bytes, returning
/// `STATUS BODY`.
fn request(url: &str, upload: Option<usize>) -> Result<String, String> {
    let (scheme, rest) = if let Some(rest) = url.strip_prefix("http://") {
        (Scheme::Http, rest)
    } else if let Some(rest) = url.strip_prefix("https://") {
        (Scheme::Https, rest)
    } else {
        return Err(format!("not an http(s) URL: {url}"));
    };
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let request = OutgoingRequest::new(Fields::new());
    let method = if upload.is_some() {
        Method::Post
    } else {
        Method::Get
    };
    request.set_method(&method).map_err(|()| "bad method")?;
    request
        .set_scheme(Some(&scheme))
        .map_err(|()| "bad scheme")?;
    request
        .set_authority(Some(authority))
        .map_err(|()| "bad authority")?;
    request
        .set_path_with_query(Some(path))
        .map_err(|()| "bad path")?;
    let body = request.body().map_err(|()| "no request body")?;
    let pending = outgoing_handler::handle(request, None).map_err(|e| format!("refused: {e:?}"))?;
    if let Some(bytes) = upload {
        let mut stream = body.write().map_err(|()| "no request body stream")?;
        let chunk = [0u8; 4096];
        let mut left = bytes;
        while left > 0 {
            let n = left.min(chunk.len());
            if stream.write_all(&chunk[..n]).is_err() {
                break;
            }
            left -= n;
        }
        drop(stream);
    }
    let _ = OutgoingBody::finish(body, None);
    pending.subscribe().block();
    let response = pending
        .get()
        .ok_or("no response")?
        .map_err(|()| "response taken twice")?
        .map_err(|e| format!("refused: {e:?}"))?;
    let status = response.status();
    let body = response.consume().map_err(|()| "no body")?;
    let mut text = String::new();
    {
        let mut stream = body.stream().map_err(|()| "no body stream")?;
        stream
            .read_to_string(&mut text)
            .map_err(|e| e.to_string())?;
    }
    drop(body);
    Ok(format!("{status} {text}"))
}

export!(Probe);
