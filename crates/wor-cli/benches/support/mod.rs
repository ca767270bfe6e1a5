//! What the server benchmarks share: the real `wor` binary started on a fresh data dir (and a
//! fresh PostgreSQL database when asked), a client of its API, and small statistics.

use std::io::{BufRead as _, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

/// The `wor` binary of this build, with a clean environment: logging at `warn`, or at the
/// bench's own `WOR_LOG` when it is set.
pub fn wor() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_wor"));
    let log = std::env::var("WOR_LOG").unwrap_or_else(|_| "warn".to_owned());
    cmd.env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("WOR_LOG", log);
    cmd
}

/// A running `wor serve`, killed when dropped.
pub struct Server {
    pub child: Child,
    pub url: String,
    pub _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// `wor init` then `wor serve` on a fresh data dir (and `database` when given), with
    /// `config` as its configuration file. Returns the server and the owner's key.
    pub fn start(database: Option<&str>, config: &str) -> (Server, String) {
        Self::start_as(database, config, "all")
    }

    /// [`Server::start`] with `--role role`.
    pub fn start_as(database: Option<&str>, config: &str, role: &str) -> (Server, String) {
        let dir = tempfile::tempdir().unwrap();
        let config_file = dir.path().join("wor.toml");
        std::fs::write(&config_file, config).unwrap();
        let mut flags = vec![
            "--data-dir".to_owned(),
            dir.path().join("data").display().to_string(),
            "--config".to_owned(),
            config_file.display().to_string(),
        ];
        if let Some(url) = database {
            flags.extend(["--database".to_owned(), url.to_owned()]);
        }
        let init = wor().arg("init").args(&flags).output().unwrap();
        assert!(
            init.status.success(),
            "{}",
            String::from_utf8_lossy(&init.stderr)
        );
        let key = String::from_utf8(init.stdout).unwrap().trim().to_owned();
        let mut serve = wor();
        serve
            .args(["serve", "--listen", "127.0.0.1:0", "--role", role])
            .args(&flags);
        let (child, url) = spawn_until(serve, "wor: listening on ");
        (
            Server {
                child,
                url,
                _dir: dir,
            },
            key,
        )
    }

    /// The flags that name this server's data dir, configuration and `database`, for operator
    /// commands on its database.
    pub fn flags(&self, database: Option<&str>) -> Vec<String> {
        let mut flags = vec![
            "--data-dir".to_owned(),
            self._dir.path().join("data").display().to_string(),
            "--config".to_owned(),
            self._dir.path().join("wor.toml").display().to_string(),
        ];
        if let Some(url) = database {
            flags.extend(["--database".to_owned(), url.to_owned()]);
        }
        flags
    }

    /// A `wor serve --role worker` enrolled with this server (on `database`), driving up to
    /// `slots` runs at once; killed when dropped.
    pub fn worker(&self, database: Option<&str>, slots: usize) -> Server {
        let token = wor()
            .args(["worker", "token", "create"])
            .args(self.flags(database))
            .output()
            .unwrap();
        assert!(
            token.status.success(),
            "{}",
            String::from_utf8_lossy(&token.stderr)
        );
        let token = String::from_utf8(token.stdout).unwrap().trim().to_owned();
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data").display().to_string();
        let enrolled = wor()
            .args([
                "worker",
                "enroll",
                "--control-plane",
                &self.url,
                "--token",
                &token,
            ])
            .args(["--data-dir", &data])
            .output()
            .unwrap();
        assert!(
            enrolled.status.success(),
            "{}",
            String::from_utf8_lossy(&enrolled.stderr)
        );
        let config = dir.path().join("worker.toml");
        std::fs::write(&config, "[egress]\nallowed_cidrs = [\"127.0.0.1/32\"]\n").unwrap();
        let mut serve = wor();
        serve
            .args([
                "serve",
                "--role",
                "worker",
                "--data-dir",
                &data,
                "--workers",
            ])
            .arg(slots.to_string())
            .arg("--config")
            .arg(&config);
        let (child, _) = spawn_until(serve, "wor: worker ");
        Server {
            child,
            url: String::new(),
            _dir: dir,
        }
    }

    /// The size of the files in the server's data dir (the SQLite database and its WAL), in
    /// KiB.
    pub fn data_kib(&self) -> u64 {
        fn size(path: &std::path::Path) -> u64 {
            match std::fs::metadata(path) {
                Ok(meta) if meta.is_dir() => std::fs::read_dir(path)
                    .map(|entries| entries.flatten().map(|e| size(&e.path())).sum())
                    .unwrap_or(0),
                Ok(meta) => meta.len(),
                Err(_) => 0,
            }
        }
        size(&self._dir.path().join("data")) / 1024
    }

    /// The CPU time the server process has used so far (see [`process_cpu_time`]).
    pub fn cpu_time(&self) -> Duration {
        process_cpu_time(&self.child.id().to_string())
    }

    /// The server process's resident memory, in KiB.
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap()
    }
}

/// The CPU time process `pid` (a number, or `self` for the bench's own) has used so far,
/// every thread's, user and system (`/proc/PID/stat`, counted in the kernel's 1/100 s ticks).
pub fn process_cpu_time(pid: &str) -> Duration {
    const TICKS_PER_SECOND: u64 = 100;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The command name (field 2) may hold spaces; the fields after it follow its `)`.
    let after_name = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after_name.split(' ').collect();
    // utime and stime are fields 14 and 15 of the whole line: 12 and 13 after the name.
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 1000 / TICKS_PER_SECOND)
}

/// Spawns `command` and waits until it logs a line starting with `ready`: the child and the
/// rest of that line. Lines logged as errors are passed on to stderr.
fn spawn_until(mut command: Command, ready: &str) -> (Child, String) {
    let mut child = command
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let wanted = ready.to_owned();
    // `WOR_BENCH_SERVER_LOG=PATH` keeps every line the servers log, appended to `PATH`.
    let mut kept = std::env::var_os("WOR_BENCH_SERVER_LOG").map(|path| {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("WOR_BENCH_SERVER_LOG {}: {e}", path.display()))
    });
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(file) = kept.as_mut() {
                use std::io::Write as _;
                // One write a line: several servers append to the same file.
                let _ = file.write_all(format!("{line}\n").as_bytes());
            }
            if let Some(rest) = line.strip_prefix(&wanted) {
                let _ = tx.send(rest.to_owned());
            } else if line.contains("\"level\":\"ERROR\"") {
                eprintln!("wor: {line}");
            }
        }
    });
    let rest = rx
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("`wor` did not log `{ready}`"));
    (child, rest)
}

/// Starts `runs` runs of `routine`, `starters` at a time.
pub async fn start_runs(api: &Api, routine: &str, runs: usize, starters: usize) {
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..starters {
        let (api, next, path) = (
            api.clone(),
            next.clone(),
            format!("/v1/routines/{routine}/runs"),
        );
        tasks.push(tokio::spawn(async move {
            while next.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < runs {
                api.post(&path, serde_json::json!({"input": "go"})).await;
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
}

/// A client of the server's API.
#[derive(Clone)]
pub struct Api {
    pub http: reqwest::Client,
    pub base: String,
    pub key: String,
}

impl Api {
    pub fn new(server: &Server, key: String) -> Api {
        #[expect(
            clippy::disallowed_methods,
            reason = "the benchmark is a client of its own server on loopback"
        )]
        let http = reqwest::Client::builder()
            .no_proxy()
            .pool_max_idle_per_host(128)
            .build()
            .unwrap();
        Api {
            http,
            base: server.url.clone(),
            key,
        }
    }

    pub async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let mut request = self
            .http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(&self.key);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.unwrap();
        let status = response.status();
        let value: Value = response.json().await.unwrap_or(Value::Null);
        assert!(status.is_success(), "{path}: {status} {value}");
        value
    }

    pub async fn get(&self, path: &str) -> Value {
        self.call(reqwest::Method::GET, path, None).await
    }

    pub async fn post(&self, path: &str, body: Value) -> Value {
        self.call(reqwest::Method::POST, path, Some(body)).await
    }

    /// Applies a routine; returns its id.
    pub async fn apply(&self, toml: &str) -> String {
        let applied = self
            .post("/v1/routines", serde_json::json!({ "toml": toml }))
            .await;
        applied["routine"]["id"].as_str().unwrap().to_owned()
    }

    /// Every run of the project with `status`, paging through the list.
    pub async fn runs_with_status(&self, status: &str) -> Vec<Value> {
        let mut all = Vec::new();
        let mut before: Option<String> = None;
        loop {
            let path = match &before {
                Some(id) => format!("/v1/runs?status={status}&limit=200&before={id}"),
                None => format!("/v1/runs?status={status}&limit=200"),
            };
            let page = self.get(&path).await;
            let items = page.as_array().cloned().unwrap_or_default();
            let full = items.len() == 200;
            before = items
                .last()
                .and_then(|r| r["id"].as_str())
                .map(str::to_owned);
            all.extend(items);
            if !full {
                return all;
            }
        }
    }

    /// Creates, reviews and enables an HTTP API connection named `name` whose tools are
    /// `tools` (HTTP API tool definitions), with `read_only` classified read-only.
    pub async fn http_tools(
        &self,
        name: &str,
        addr: std::net::SocketAddr,
        tools: Value,
        read_only: &[&str],
    ) {
        let created = self
            .post(
                "/v1/tool-connections",
                serde_json::json!({"name": name, "kind": "http_api",
                    "url": format!("http://{addr}/v1"), "allowlist": [addr.to_string()],
                    "tools": tools}),
            )
            .await;
        self.enable(created["id"].as_str().unwrap(), read_only)
            .await;
    }

    /// Creates, reviews and enables an MCP connection over streamable HTTP at `url`.
    pub async fn mcp_tools(&self, name: &str, addr: std::net::SocketAddr, read_only: &[&str]) {
        let created = self
            .post(
                "/v1/tool-connections",
                serde_json::json!({"name": name, "kind": "mcp_http",
                    "url": format!("http://{addr}/mcp"), "allowlist": [addr.to_string()]}),
            )
            .await;
        self.enable(created["id"].as_str().unwrap(), read_only)
            .await;
    }

    async fn enable(&self, id: &str, read_only: &[&str]) {
        let review = self.get(&format!("/v1/tool-connections/{id}/review")).await;
        let hashes: serde_json::Map<String, Value> = review["tools"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| (t["name"].as_str().unwrap().to_owned(), t["hash"].clone()))
            .collect();
        self.post(
            &format!("/v1/tool-connections/{id}/enable"),
            serde_json::json!({"tools": hashes, "read_only": read_only}),
        )
        .await;
    }
}

/// The databases [`fresh_postgres`] made and [`drop_fresh_databases`] has not dropped yet.
static FRESH_DATABASES: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// A fresh PostgreSQL database on the server of `base`, for one measurement; dropped by
/// [`drop_fresh_databases`].
pub async fn fresh_postgres(base: &str) -> String {
    sqlx::any::install_default_drivers();
    let name = format!(
        "wor_bench_{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    let admin = sqlx::AnyPool::connect(base).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&admin)
        .await
        .unwrap();
    admin.close().await;
    FRESH_DATABASES.lock().unwrap().push(name.clone());
    let mut url = url::Url::parse(base).unwrap();
    url.set_path(&format!("/{name}"));
    url.to_string()
}

/// Drops every database [`fresh_postgres`] made on the server of `base` (None: SQLite, whose
/// files go with their data dirs), once the servers that used them have stopped; one a server
/// left connected is dropped all the same.
pub async fn drop_fresh_databases(base: &Option<String>) {
    let Some(base) = base else {
        return;
    };
    let names = std::mem::take(&mut *FRESH_DATABASES.lock().unwrap());
    if names.is_empty() {
        return;
    }
    let admin = sqlx::AnyPool::connect(base).await.unwrap();
    for name in names {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
        )))
        .execute(&admin)
        .await
        .unwrap();
    }
    admin.close().await;
}

/// The backends to measure: SQLite always, PostgreSQL when `WOR_BENCH_PG_URL` names a server.
pub fn backends() -> Vec<(&'static str, Option<String>)> {
    let mut backends = vec![("sqlite", None)];
    if let Ok(base) = std::env::var("WOR_BENCH_PG_URL") {
        backends.push(("postgres", Some(base)));
    }
    backends
}

/// A fresh database for one measurement on `backend` (None: SQLite in the data dir).
pub async fn database_for(base: &Option<String>) -> Option<String> {
    match base {
        Some(base) => Some(fresh_postgres(base).await),
        None => None,
    }
}

/// The value at fraction `p` of `sorted`.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Milliseconds between two RFC 3339 timestamps of a run view.
pub fn between(run: &Value, from: &str, to: &str) -> Option<Duration> {
    let parse = |key: &str| {
        run[key]
            .as_str()
            .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
    };
    let (a, b) = (parse(from)?, parse(to)?);
    (b - a).to_std().ok()
}

/// A number from the environment, or `default` when it is not set or set empty. Any other
/// value that is not a whole number stops the benchmark rather than measuring something else
/// than was asked.
pub fn env_number(name: &str, default: usize) -> usize {
    let Some(value) = std::env::var_os(name) else {
        return default;
    };
    let text = value.to_string_lossy();
    if text.trim().is_empty() {
        return default;
    }
    text.trim()
        .parse()
        .unwrap_or_else(|_| panic!("{name} is a whole number, not `{text}`"))
}
