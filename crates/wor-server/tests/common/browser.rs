//! A browser without script for the console's tests: one cookie jar, CSRF fields read from
//! pages, redirects not followed; and members invited and signed in through it.
#![allow(
    dead_code,
    clippy::disallowed_methods,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "the test plays a browser reaching the server under test on loopback"
)]

use std::collections::BTreeMap;
use std::net::SocketAddr;

use axum::http::{Method, StatusCode};
use reqwest::header::{HeaderMap, LOCATION, SET_COOKIE};
use serde_json::{Value, json};

use crate::common::Harness;

/// A browser: one cookie jar, no script, no redirects followed.
pub struct Browser {
    pub base: String,
    pub client: reqwest::Client,
    pub cookies: BTreeMap<String, String>,
}

pub struct Page {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: String,
}

impl Page {
    pub fn location(&self) -> &str {
        self.headers
            .get(LOCATION)
            .map(|v| v.to_str().unwrap())
            .unwrap_or("")
    }

    pub fn set_cookies(&self) -> Vec<String> {
        self.headers
            .get_all(SET_COOKIE)
            .iter()
            .map(|v| v.to_str().unwrap().to_owned())
            .collect()
    }

    /// The value of the first hidden `csrf` field.
    pub fn csrf(&self) -> String {
        self.hidden("csrf")
    }

    /// The value of the first hidden field named `name`.
    pub fn hidden(&self, name: &str) -> String {
        let field = format!("name=\"{name}\" value=\"");
        let start = self
            .body
            .find(&field)
            .unwrap_or_else(|| panic!("a {name} field"))
            + field.len();
        let rest = &self.body[start..];
        rest[..rest.find('"').unwrap()].to_owned()
    }
}

impl Browser {
    pub fn new(addr: SocketAddr) -> Self {
        Browser {
            base: format!("http://{addr}"),
            client: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .unwrap(),
            cookies: BTreeMap::new(),
        }
    }

    pub async fn send(&mut self, request: reqwest::RequestBuilder) -> Page {
        let cookie = self
            .cookies
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join("; ");
        let request = if cookie.is_empty() {
            request
        } else {
            request.header("cookie", cookie)
        };
        let response = request.send().await.unwrap();
        let status = StatusCode::from_u16(response.status().as_u16()).unwrap();
        let headers = response.headers().clone();
        for set in headers.get_all(SET_COOKIE) {
            let text = set.to_str().unwrap();
            let (pair, attributes) = text.split_once(';').unwrap_or((text, ""));
            let (name, value) = pair.split_once('=').unwrap();
            if attributes.contains("Max-Age=0") {
                self.cookies.remove(name);
            } else {
                self.cookies.insert(name.to_owned(), value.to_owned());
            }
        }
        let body = response.text().await.unwrap();
        Page {
            status,
            headers,
            body,
        }
    }

    pub async fn get(&mut self, path: &str) -> Page {
        let request = self.client.get(format!("{}{path}", self.base));
        self.send(request).await
    }

    pub async fn post(&mut self, path: &str, form: &[(&str, &str)]) -> Page {
        let request = self
            .client
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(encode(form));
        self.send(request).await
    }

    /// Opens invitation `path` and sets `password`.
    pub async fn accept(&mut self, path: &str, password: &str) -> Page {
        let page = self.get(path).await;
        assert_eq!(page.status, StatusCode::OK, "{}", page.body);
        let csrf = page.csrf();
        self.post(
            path,
            &[
                ("csrf", &csrf),
                ("password", password),
                ("repeat", password),
            ],
        )
        .await
    }

    pub async fn sign_in(&mut self, project: &str, name: &str, password: &str) -> Page {
        let page = self.get("/console/sign-in").await;
        assert_eq!(page.status, StatusCode::OK, "{}", page.body);
        let csrf = page.csrf();
        self.post(
            "/console/sign-in",
            &[
                ("csrf", &csrf),
                ("project", project),
                ("name", name),
                ("password", password),
            ],
        )
        .await
    }
}

/// A form body, as a browser encodes it.
pub fn encode(form: &[(&str, &str)]) -> String {
    url::form_urlencoded::Serializer::new(String::new())
        .extend_pairs(form)
        .finish()
}

/// Serves `h`'s router on loopback, with the peer address visible to handlers.
pub async fn serve_console(h: &Harness) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = h.router.clone();
    tokio::spawn(async move {
        axum::serve(
            listener,
            router.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .unwrap();
    });
    addr
}

pub async fn invite(h: &Harness, key: &str, name: &str, role: Option<&str>) -> (StatusCode, Value) {
    let (status, body, _) = h
        .call_as(
            key,
            Method::POST,
            "/v1/invitations",
            Some(json!({"name": name, "role": role})),
        )
        .await;
    (status, body)
}

/// Invites `name` with `role`, sets their password and signs them in.
pub async fn signed_in(h: &Harness, addr: SocketAddr, name: &str, role: Option<&str>) -> Browser {
    let (status, invitation) = invite(h, h.owner(), name, role).await;
    assert_eq!(status, StatusCode::CREATED, "{invitation}");
    let mut browser = Browser::new(addr);
    let page = browser
        .accept(
            invitation["path"].as_str().unwrap(),
            "a long and quiet passphrase",
        )
        .await;
    assert_eq!(page.status, StatusCode::SEE_OTHER, "{}", page.body);
    let page = browser
        .sign_in(&h.project.project.name, name, "a long and quiet passphrase")
        .await;
    assert_eq!(page.status, StatusCode::SEE_OTHER, "{}", page.body);
    browser
}
