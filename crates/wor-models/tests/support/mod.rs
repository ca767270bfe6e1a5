//! A loopback HTTP/1.1 mock for model providers: answers the n-th request with the n-th
//! scripted reply (the last one repeats), written in pieces so streams arrive in chunks, and
//! records every request (headers, body, arrival time).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use wor_egress::{EgressClient, EgressLimits, EgressPolicy, StaticResolver};

/// One request as the mock saw it.
#[derive(Debug, Clone)]
pub struct CapturedRequest {
    pub request_line: String,
    /// Header names lower-cased.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub at: Instant,
}

impl CapturedRequest {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap()
    }
}

/// What the mock writes back: the pieces of one raw HTTP response, then it closes.
#[derive(Debug, Clone)]
pub enum Reply {
    Pieces(Vec<Vec<u8>>),
    /// Never answer.
    Silence,
}

pub struct MockServer {
    pub addr: SocketAddr,
    requests: Arc<Mutex<Vec<CapturedRequest>>>,
}

impl MockServer {
    pub async fn start(replies: Vec<Reply>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&requests);
        tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    return;
                };
                let seen = Arc::clone(&seen);
                let replies = replies.clone();
                tokio::spawn(async move {
                    let Some(request) = read_request(&mut stream).await else {
                        return;
                    };
                    let number = {
                        let mut seen = seen.lock().unwrap();
                        seen.push(request);
                        seen.len() - 1
                    };
                    let reply = replies
                        .get(number)
                        .or(replies.last())
                        .cloned()
                        .unwrap_or(Reply::Silence);
                    match reply {
                        Reply::Pieces(pieces) => {
                            for piece in pieces {
                                if stream.write_all(&piece).await.is_err() {
                                    return;
                                }
                                let _ = stream.flush().await;
                                tokio::time::sleep(Duration::from_millis(2)).await;
                            }
                            let _ = stream.shutdown().await;
                        }
                        Reply::Silence => tokio::time::sleep(Duration::from_secs(30)).await,
                    }
                });
            }
        });
        Self { addr, requests }
    }

    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn requests(&self) -> Vec<CapturedRequest> {
        self.requests.lock().unwrap().clone()
    }
}

async fn read_request(stream: &mut tokio::net::TcpStream) -> Option<CapturedRequest> {
    let mut seen = Vec::new();
    let mut buf = [0u8; 8192];
    let head_end = loop {
        if let Some(at) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
            break at;
        }
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => seen.extend_from_slice(&buf[..n]),
        }
    };
    let at = Instant::now();
    let head = String::from_utf8_lossy(&seen[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let request_line = lines.next().unwrap_or_default().to_owned();
    let headers: Vec<(String, String)> = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let length: usize = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = seen[head_end + 4..].to_vec();
    while body.len() < length {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => body.extend_from_slice(&buf[..n]),
        }
    }
    Some(CapturedRequest {
        request_line,
        headers,
        body,
        at,
    })
}

/// A complete JSON response with `status` and extra header lines.
pub fn json_reply(status: u16, extra_headers: &[&str], body: &str) -> Reply {
    let mut head = format!(
        "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
        body.len()
    );
    for header in extra_headers {
        head.push_str(header);
        head.push_str("\r\n");
    }
    head.push_str("\r\n");
    head.push_str(body);
    Reply::Pieces(vec![head.into_bytes()])
}

/// An event stream: the header, then `body` in pieces of `piece` bytes; ends when the
/// connection closes.
pub fn sse_reply(body: &str, piece: usize) -> Reply {
    let mut pieces = vec![
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n".to_vec(),
    ];
    pieces.extend(body.as_bytes().chunks(piece).map(<[u8]>::to_vec));
    Reply::Pieces(pieces)
}

/// An egress client whose policy allows 127.0.0.1 only (the mock's address).
pub use wor_egress::testing::loopback_egress;

/// An egress client with the plain development policy: loopback refused.
pub fn guarded_egress() -> EgressClient {
    EgressClient::with_resolver(
        EgressPolicy::development(),
        Arc::new(StaticResolver::new()),
        EgressLimits::default(),
    )
    .unwrap()
}
