//! Helpers shared by the binary's integration tests: a clean-environment `wor` command and a
//! real server on a loopback port.
#![allow(
    dead_code,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly; not every test binary uses every helper"
)]

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const WOR: &str = env!("CARGO_BIN_EXE_wor");

/// A command with a clean environment: nothing from the developer's shell leaks in.
pub fn wor(args: &[&str]) -> Command {
    let mut cmd = Command::new(WOR);
    cmd.args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .stdin(Stdio::null());
    cmd
}

pub fn run(cmd: &mut Command) -> Output {
    cmd.output().unwrap()
}

pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The database a server test runs on: a PostgreSQL database of the test's own when CI
/// configures PostgreSQL (a server's workers claim whatever runs their database holds, so
/// tests must not share one), else the SQLite file in the data dir. The data dir is always
/// given: it holds the development key and the audit signing key.
pub fn database_args(dir: &Path) -> Vec<String> {
    let mut args = vec!["--data-dir".into(), dir.display().to_string()];
    if let Ok(url) = std::env::var("WOR_TEST_DATABASE_URL")
        && !url.is_empty()
    {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let own = runtime
            .block_on(wor_store::testing::TestDatabase::fresh_url(dir))
            .unwrap();
        args.extend(["--database".into(), own]);
    }
    args
}

/// The database URL a test's binaries use (from their arguments), for opening it from the
/// test as an attacker.
pub fn database_url(db: &[String], dir: &Path) -> String {
    db.iter()
        .position(|a| a == "--database")
        .and_then(|i| db.get(i + 1).cloned())
        .unwrap_or_else(|| format!("sqlite://{}", dir.join("wor.db").display()))
}

/// Like [`database_args`], but with a database of the test's own, for commands that work on
/// a whole database.
pub async fn own_database_args(dir: &Path) -> Vec<String> {
    let url = wor_store::testing::TestDatabase::fresh_url(dir)
        .await
        .unwrap();
    vec![
        "--data-dir".into(),
        dir.display().to_string(),
        "--database".into(),
        url,
    ]
}

/// Creates a project through the operator command and returns its owner key.
pub fn create_project(db: &[String]) -> String {
    let name = format!("cli-{}", std::process::id())
        + &format!("-{:?}", Instant::now()).replace([' ', '.', ':'], "");
    let mut args = vec!["project", "create", name.as_str()];
    args.extend(db.iter().map(String::as_str));
    let out = run(&mut wor(&args));
    assert!(out.status.success(), "{}", text(&out.stderr));
    text(&out.stdout).trim().to_owned()
}

pub struct Server {
    pub child: Child,
    pub url: String,
    pub log: Arc<Mutex<String>>,
}

impl Server {
    pub fn start(db: &[String], envs: &[(&str, &str)]) -> Server {
        let mut args = vec!["serve", "--listen", "127.0.0.1:0"];
        args.extend(db.iter().map(String::as_str));
        Server::spawn_with(&args, envs, "wor: listening on ")
    }

    /// Spawns `wor ARGS` with a clean environment and waits until it logs a line that starts
    /// with `ready`; the rest of that line is the server's URL (empty when there is none).
    pub fn spawn(args: &[&str], ready: &str) -> Server {
        Server::spawn_with(args, &[], ready)
    }

    /// [`Server::spawn`] with `envs` added to the clean environment.
    pub fn spawn_with(args: &[&str], envs: &[(&str, &str)], ready: &str) -> Server {
        Server::try_spawn_within(args, envs, ready, Duration::from_secs(30))
            .unwrap_or_else(|why| panic!("{why}"))
    }

    /// [`Server::spawn_with`], waiting `within` for the line; what went wrong when the
    /// process did not start (it is killed then).
    pub fn try_spawn_within(
        args: &[&str],
        envs: &[(&str, &str)],
        ready: &str,
        within: Duration,
    ) -> Result<Server, String> {
        let mut child = wor(args)
            .envs(envs.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let sink = log.clone();
        let ready = ready.to_owned();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix(&ready) {
                    let _ = tx.send(rest.to_owned());
                }
                let mut log = sink.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
        });
        // Waits for the line, or for the process to end without it.
        let deadline = Instant::now() + within;
        let url = loop {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(url) => break url,
                Err(_) if Instant::now() >= deadline => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(format!(
                        "{args:?} did not start within {within:?}: {}",
                        log.lock().unwrap()
                    ));
                }
                Err(_) => {
                    if let Ok(Some(status)) = child.try_wait() {
                        std::thread::sleep(Duration::from_millis(200));
                        return Err(format!(
                            "{args:?} exited with {status} before it started: {}",
                            log.lock().unwrap()
                        ));
                    }
                }
            }
        };
        Ok(Server { child, url, log })
    }

    /// `wor serve --role worker` on `data_dir` with `config`, driving up to four runs at once.
    pub fn worker(data_dir: &Path, config: &Path) -> Server {
        Server::try_worker(data_dir, config, Duration::from_secs(30))
            .unwrap_or_else(|why| panic!("{why}"))
    }

    /// [`Server::worker`], waiting `within` for it to start.
    pub fn try_worker(data_dir: &Path, config: &Path, within: Duration) -> Result<Server, String> {
        Server::try_spawn_within(
            &[
                "serve",
                "--role",
                "worker",
                "--data-dir",
                data_dir.to_str().unwrap(),
                "--config",
                config.to_str().unwrap(),
                "--workers",
                "4",
            ],
            &[],
            "wor: worker ",
            within,
        )
    }

    pub fn client(&self, key: &str, args: &[&str]) -> Output {
        run(wor(args)
            .env("WOR_SERVER", &self.url)
            .env("WOR_API_KEY", key))
    }

    /// Sends a raw HTTP/1.1 request and returns the whole response text.
    pub fn raw(&self, request: &str) -> String {
        let addr = self.url.trim_start_matches("http://").to_owned();
        #[expect(
            clippy::disallowed_methods,
            reason = "the test talks to its own server on loopback"
        )]
        let mut stream = std::net::TcpStream::connect(addr).unwrap();
        stream.write_all(request.as_bytes()).unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        response
    }

    /// Sends the server `signal` (`-HUP`, `-TERM`, …).
    pub fn signal(&self, signal: &str) {
        let sent = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success(), "kill {signal} failed");
    }

    /// Waits up to `within` for the server to log a line holding `needle`.
    pub fn wait_logged(&self, needle: &str, within: Duration) {
        let deadline = Instant::now() + within;
        while !self.log.lock().unwrap().contains(needle) {
            assert!(
                Instant::now() < deadline,
                "no `{needle}` logged: {}",
                self.log.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops the server with SIGTERM and returns everything it logged; a server a test does
    /// not stop is killed when it is dropped.
    pub fn stop(self) -> String {
        let _ = Command::new("kill")
            .arg(self.child.id().to_string())
            .status();
        self.stopped()
    }

    /// Waits for a server already sent SIGTERM to stop (a second signal would end its drain
    /// at once), and returns everything it logged.
    pub fn stopped(mut self) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                assert!(status.success(), "server exited with {status}");
                std::thread::sleep(Duration::from_millis(100));
                return self.log.lock().unwrap().clone();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        panic!("server did not stop on SIGTERM");
    }
}

/// A test that ends, passing or failing, without stopping its server leaves no process behind.
impl Drop for Server {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A single-use worker enrolment token, made on the database directly.
pub fn create_token(db: &[String]) -> String {
    let mut args = vec!["worker", "token", "create"];
    args.extend(db.iter().map(String::as_str));
    let out = run(&mut wor(&args));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let token = text(&out.stdout).trim().to_owned();
    assert!(token.starts_with("wet_") && token.len() == 68, "{token}");
    token
}

/// `wor worker enroll` of a worker whose data dir is `data_dir`.
pub fn enroll(
    control_plane: &str,
    token: &str,
    data_dir: &std::path::Path,
) -> std::process::Output {
    run(&mut wor(&[
        "worker",
        "enroll",
        "--control-plane",
        control_plane,
        "--token",
        token,
        "--data-dir",
        data_dir.to_str().unwrap(),
        "--name",
        "test-worker",
    ]))
}

/// Serves `handler` as an MCP server (streamable HTTP at `/mcp`) on a loopback port, on the
/// current tokio runtime; its address.
pub async fn serve_mcp<H>(handler: H) -> std::net::SocketAddr
where
    H: rmcp::ServerHandler + Clone + Send + Sync + 'static,
{
    use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
    use rmcp::transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService,
    };
    let service = StreamableHttpService::new(
        move || Ok(handler.clone()),
        Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default(),
    );
    serve_router(axum::Router::new().nest_service("/mcp", service)).await
}

/// Serves `router` on a loopback port, on the current tokio runtime; its address. Its
/// connections send each write at once (`TCP_NODELAY`), as `wor`'s own servers do: with
/// Nagle's algorithm on, an MCP answer sent as server-sent events waits about 40 ms for the
/// client's delayed acknowledgement.
pub async fn serve_router(router: axum::Router) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let listener = wor_server::sending_at_once(listener);
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    addr
}

/// Creates model connection `main` on `server` as `owner`, its API key `key` (sealed by the
/// server: a secret in the database).
pub fn create_model_connection(server: &Server, owner: &str, key: &str) {
    let created = run(wor(&[
        "model-connection",
        "create",
        "main",
        "--provider",
        "openai_compatible",
        "--base-url",
        "https://models.example.com/v1",
        "--api-key-env",
        "MODEL_KEY",
    ])
    .env("WOR_SERVER", &server.url)
    .env("WOR_API_KEY", owner)
    .env("MODEL_KEY", key));
    assert!(created.status.success(), "{}", text(&created.stderr));
}

/// Creates `http_api` connection `api` on `server` as `owner`, its tools read from the tools
/// file `tools` and its API at `http://127.0.0.1:9/v1` (allowlisted; nothing listens there),
/// and returns its id. It is pending review.
pub fn create_tools_file_connection(
    server: &Server,
    owner: &str,
    tools: &std::path::Path,
) -> String {
    let created = server.client(
        owner,
        &[
            "connection",
            "create",
            "api",
            "--tools-file",
            tools.to_str().unwrap(),
            "--url",
            "http://127.0.0.1:9/v1",
            "--allow",
            "127.0.0.1",
            "--json",
        ],
    );
    assert!(created.status.success(), "{}", text(&created.stderr));
    let created: serde_json::Value = serde_json::from_slice(&created.stdout).unwrap();
    created["id"].as_str().unwrap().to_owned()
}
