//! Engine benchmark: what a governed tool call, a run start and a parked run cost through the
//! real `wor serve` (release build), each figure beside a baseline measured in the same run.
//! One line per figure, on SQLite and (with `WOR_BENCH_PG_URL`) on PostgreSQL.
//!
//! ```sh
//! cargo bench -p wor-cli --bench engine
//! WOR_BENCH_PG_URL=postgres://wor@127.0.0.1:5432/postgres cargo bench -p wor-cli --bench engine
//! WOR_BENCH_ONLY=call,parked WOR_BENCH_PARKED=200 cargo bench -p wor-cli --bench engine
//! ```
//!
//! `WOR_BENCH_SERVER_LOG=PATH` appends every line the servers log to `PATH` (at `warn`, or at
//! the level `WOR_LOG` sets). `WOR_BENCH_INTERVALS=PATH` writes the `call` figure's intervals, in
//! call order and in µs, to `PATH.sqlite` (and, with `WOR_BENCH_PG_URL`, `PATH.postgres`).
//!
//! Figures (`WOR_BENCH_ONLY` picks some): `call` — added latency of a tool call through a
//! routine (replay model, read-only echo tool on a loopback MCP server) against a direct
//! JSON-RPC call to the same server; `observed` — the same call through a routine with
//! `[metrics] listen` and `[traces] endpoint` (an in-bench loopback collector that accepts and
//! discards) against the same server without them, the two side by side in each round;
//! `throughput` — tool calls per second with 32 runs at once (a pool of 32), each followed,
//! against 32 direct callers, and again with no one following the runs, with the CPU each
//! phase used a call, the server's and the bench's own (the direct callers, the echo tool's
//! server, and the runs' starters, followers and final status reads), and the calls per
//! CPU-second of the runs not followed against the direct callers'; each ratio is taken within
//! a round, which measures the direct callers and both halves one after the other, and the
//! figure gives its median and range over the rounds (`WOR_BENCH_THROUGHPUT_ROUNDS`, 3 unless
//! set; `WOR_BENCH_AT_ONCE` sets another number of runs and callers, `WOR_BENCH_TOOL_MS` a time
//! the echo tool takes to answer each call, for the direct callers and the runs alike);
//! `trivial` — runs of one model turn per second with 1, 8 and 32 concurrent starters, and
//! enqueue → start; `cron` — routines whose schedule fires in the same minute, dispatch lag (a
//! run recorded ahead of its slot counts as dispatched at the slot, when it becomes claimable)
//! against inserting as many rows in one transaction (`WOR_BENCH_CRON_OVERLAP=skip` gives the
//! routines an overlap policy whose slots start at their time, never ahead); `parked` — server
//! memory per run waiting for approval, and starting a run with none and with many parked.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a benchmark fails loudly and reports on stdout"
)]

#[allow(dead_code, reason = "each benchmark uses a part of the shared support")]
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rmcp::ServerHandler;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ErrorData,
    InitializeResult, ListToolsResult, PaginatedRequestParams, ServerCapabilities, Tool,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use serde_json::json;
use support::{
    Api, Server, backends, between, database_for, drop_fresh_databases, env_number, ms, percentile,
    process_cpu_time,
};

const LOOPBACK_CONFIG: &str = "[egress]\nallowed_cidrs = [\"127.0.0.1/32\"]\n";

/// The echo tool server: answers `#N#` (its N-th call) and notes when each call arrived.
#[derive(Clone, Default)]
struct Echo {
    calls: Arc<AtomicUsize>,
    arrivals: Arc<std::sync::Mutex<Vec<Instant>>>,
    /// How long each call takes before it is answered: none unless a figure sets it.
    takes: Duration,
}

impl ServerHandler for Echo {
    fn get_info(&self) -> InitializeResult {
        InitializeResult::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let schema = json!({"type": "object", "properties": {"text": {"type": "string"}}})
            .as_object()
            .cloned()
            .unwrap();
        Ok(ListToolsResult::with_all_items(vec![Tool::new(
            "echo",
            "Returns its call number.",
            Arc::new(schema),
        )]))
    }

    async fn call_tool(
        &self,
        _request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        self.arrivals.lock().unwrap().push(Instant::now());
        if !self.takes.is_zero() {
            tokio::time::sleep(self.takes).await;
        }
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(CallToolResult::success(vec![ContentBlock::text(format!("#{n}#"))]).into())
    }
}

async fn serve_echo(echo: Echo) -> std::net::SocketAddr {
    // Stateless, answering in plain JSON: the direct baseline is one POST per call.
    let config = StreamableHttpServerConfig::default()
        .with_legacy_session_mode(false)
        .with_json_response(true);
    let service = StreamableHttpService::new(
        move || Ok(echo.clone()),
        Arc::new(LocalSessionManager::default()),
        config,
    );
    let app = axum::Router::new().nest_service("/mcp", service);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// One direct JSON-RPC `tools/call` to the echo server, as a client without `wor` makes it.
async fn direct_call(http: &reqwest::Client, addr: std::net::SocketAddr) -> Duration {
    let started = Instant::now();
    let response = http
        .post(format!("http://{addr}/mcp"))
        .header("accept", "application/json, text/event-stream")
        .header("content-type", "application/json")
        .body(
            json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                   "params": {"name": "echo", "arguments": {"text": "hi"}}})
            .to_string(),
        )
        .send()
        .await
        .unwrap();
    let body = response.text().await.unwrap();
    assert!(body.contains("#"), "unexpected answer: {body}");
    started.elapsed()
}

fn client() -> reqwest::Client {
    #[expect(
        clippy::disallowed_methods,
        reason = "the benchmark's baseline client on loopback"
    )]
    reqwest::Client::builder().no_proxy().build().unwrap()
}

/// A routine that calls `echo` until the `calls`-th answer, then ends.
fn echo_routine(name: &str, calls: usize) -> String {
    format!(
        r##"
name = "{name}"
instructions = "Echo."
[model]
provider = "replay"
model = "script"
[[model.script.turns]]
when = {{ last_tool_result_contains = "#{calls}#" }}
text = "done"
[[model.script.turns]]
tool_calls = [{{ name = "echo__echo", arguments = {{ text = "hi" }} }}]
repeat = true
[budget]
turns = {turns}
tool_calls = {calls}
input_tokens = 1000000000
[concurrency]
max_runs = 64
[[tools]]
tool = "echo/echo"
mode = "auto"
"##,
        turns = calls + 2
    )
}

const TRIVIAL: &str = r#"
name = "trivial"
instructions = "Answer."
[model]
provider = "replay"
model = "script"
[[model.script.turns]]
text = "ok"
repeat = true
[concurrency]
max_runs = 1000
"#;

/// Starts a run of `routine`; its id.
async fn start_run(api: &Api, routine: &str) -> String {
    let run = api
        .post(
            &format!("/v1/routines/{routine}/runs"),
            json!({"input": "go"}),
        )
        .await;
    run["id"].as_str().unwrap().to_owned()
}

/// Starts a run of `routine` and follows its events to the end; the run's id.
async fn start_and_follow(api: &Api, routine: &str) -> String {
    let id = start_run(api, routine).await;
    let mut response = api
        .http
        .get(format!("{}/v1/runs/{id}/events", api.base))
        .bearer_auth(&api.key)
        .send()
        .await
        .unwrap();
    // Only the last bytes of what came before are kept, for a marker split across chunks:
    // searching everything seen at each chunk cost the bench more with every event, and its
    // CPU is the server's too.
    const END: &[u8] = b"event: end";
    let mut tail: Vec<u8> = Vec::new();
    while let Some(chunk) = response.chunk().await.unwrap() {
        tail.extend_from_slice(&chunk);
        if tail.windows(END.len()).any(|window| window == END) {
            break;
        }
        tail.drain(..tail.len().saturating_sub(END.len() - 1));
    }
    id
}

async fn figure_call(backend: &str, base: &Option<String>) {
    let calls = env_number("WOR_BENCH_CALLS", 200);
    let echo = Echo::default();
    let addr = serve_echo(echo.clone()).await;
    let http = client();
    for _ in 0..50 {
        direct_call(&http, addr).await;
    }
    let mut direct: Vec<Duration> = Vec::new();
    for _ in 0..calls {
        direct.push(direct_call(&http, addr).await);
    }
    direct.sort();

    let (server, key) = Server::start(database_for(base).await.as_deref(), LOOPBACK_CONFIG);
    let api = Api::new(&server, key);
    api.mcp_tools("echo", addr, &["echo"]).await;
    echo.calls.store(0, Ordering::SeqCst);
    let warm = api.apply(&echo_routine("warm", 10)).await;
    start_and_follow(&api, &warm).await;
    echo.calls.store(0, Ordering::SeqCst);
    echo.arrivals.lock().unwrap().clear();
    let routine = api.apply(&echo_routine("echo", calls)).await;
    let run = start_and_follow(&api, &routine).await;
    let arrivals = echo.arrivals.lock().unwrap().clone();
    assert_eq!(arrivals.len(), calls, "run {run} made every call");
    let mut intervals: Vec<Duration> = arrivals.windows(2).map(|w| w[1] - w[0]).collect();
    if let Ok(path) = std::env::var("WOR_BENCH_INTERVALS") {
        // Each interval in call order, in µs, for finding where the slow ones fall.
        let lines: Vec<String> = intervals
            .iter()
            .map(|i| i.as_micros().to_string())
            .collect();
        std::fs::write(format!("{path}.{backend}"), lines.join("\n") + "\n").unwrap();
    }
    intervals.sort();
    let (d50, d99) = (percentile(&direct, 0.5), percentile(&direct, 0.99));
    let (i50, i99) = (percentile(&intervals, 0.5), percentile(&intervals, 0.99));
    println!(
        "{backend:<8} call        direct p50={:.3}ms p99={:.3}ms | through a routine, call to call \
         p50={:.3}ms p99={:.3}ms | added p50=+{:.3}ms p99=+{:.3}ms ({calls} calls)",
        ms(d50),
        ms(d99),
        ms(i50),
        ms(i99),
        ms(i50.saturating_sub(d50)),
        ms(i99.saturating_sub(d99)),
    );
}

/// A loopback OTLP/HTTP collector that answers every export with an empty success and keeps
/// nothing; counts the requests it got.
async fn serve_collector(requests: Arc<AtomicUsize>) -> std::net::SocketAddr {
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |_body: axum::body::Bytes| {
            let requests = requests.clone();
            async move {
                requests.fetch_add(1, Ordering::SeqCst);
                (
                    [("content-type", "application/x-protobuf")],
                    Vec::<u8>::new(),
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// The call-to-call intervals of one routine run of `calls` echo calls on a fresh server
/// started with `config`, and the server's CPU time during that run. The run starts only once
/// every other party of `together` is ready to start its own.
async fn call_intervals(
    base: &Option<String>,
    config: &str,
    echo: &Echo,
    addr: std::net::SocketAddr,
    calls: usize,
    together: &tokio::sync::Barrier,
) -> (Vec<Duration>, Duration) {
    let (server, key) = Server::start(database_for(base).await.as_deref(), config);
    let api = Api::new(&server, key);
    api.mcp_tools("echo", addr, &["echo"]).await;
    echo.calls.store(0, Ordering::SeqCst);
    let warm = api.apply(&echo_routine("warm", 10)).await;
    start_and_follow(&api, &warm).await;
    echo.calls.store(0, Ordering::SeqCst);
    echo.arrivals.lock().unwrap().clear();
    let routine = api.apply(&echo_routine("echo", calls)).await;
    together.wait().await;
    let cpu_before = server.cpu_time();
    let run = start_and_follow(&api, &routine).await;
    let cpu = server.cpu_time().saturating_sub(cpu_before);
    let arrivals = echo.arrivals.lock().unwrap().clone();
    assert_eq!(arrivals.len(), calls, "run {run} made every call");
    drop(server);
    let mut intervals: Vec<Duration> = arrivals.windows(2).map(|w| w[1] - w[0]).collect();
    intervals.sort();
    (intervals, cpu)
}

/// A governed tool call with metrics and tracing on against off. In each round two servers
/// run side by side, one with neither and one with `[metrics] listen` and `[traces] endpoint`
/// at a loopback collector, each calling its own echo server, their runs released together:
/// whatever else the machine does in that second falls on both alike.
async fn figure_observed(backend: &str, base: &Option<String>) {
    let calls = env_number("WOR_BENCH_CALLS", 200);
    let rounds = env_number("WOR_BENCH_OBSERVED_ROUNDS", 3);
    let (echo_off, echo_on) = (Echo::default(), Echo::default());
    let addr_off = serve_echo(echo_off.clone()).await;
    let addr_on = serve_echo(echo_on.clone()).await;
    let exports = Arc::new(AtomicUsize::new(0));
    let collector = serve_collector(exports.clone()).await;
    let observed = format!(
        "{LOOPBACK_CONFIG}\n[metrics]\nlisten = \"127.0.0.1:0\"\n\n[traces]\n\
         endpoint = \"http://{collector}/v1/traces\"\nallowed_cidrs = [\"127.0.0.1/32\"]\n"
    );
    let (mut off, mut on) = (Vec::new(), Vec::new());
    let (mut off_cpu, mut on_cpu) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..rounds {
        let together = tokio::sync::Barrier::new(2);
        let ((off_round, off_round_cpu), (on_round, on_round_cpu)) = tokio::join!(
            call_intervals(base, LOOPBACK_CONFIG, &echo_off, addr_off, calls, &together),
            call_intervals(base, &observed, &echo_on, addr_on, calls, &together),
        );
        off.extend(off_round);
        off_cpu += off_round_cpu;
        on.extend(on_round);
        on_cpu += on_round_cpu;
    }
    // The server's CPU time per call, its whole run included (model turns, journal writes,
    // and with observation on, every metric, span and export): what observation costs the
    // machine, less swayed than latency by how one server's disk writes happened to fall.
    let per_call = |cpu: Duration| cpu.as_secs_f64() * 1e6 / (rounds * calls) as f64;
    let (off_us, on_us) = (per_call(off_cpu), per_call(on_cpu));
    assert!(
        exports.load(Ordering::SeqCst) > 0,
        "the collector got no export: tracing was not on"
    );
    off.sort();
    on.sort();
    let (off50, off99) = (percentile(&off, 0.5), percentile(&off, 0.99));
    let (on50, on99) = (percentile(&on, 0.5), percentile(&on, 0.99));
    println!(
        "{backend:<8} observed    call to call, off p50={:.3}ms p99={:.3}ms | metrics and traces on \
         p50={:.3}ms p99={:.3}ms | difference p50 {:+.1}% p99 {:+.1}% ({rounds} rounds of {calls} \
         calls each, side by side; {} exports) | server CPU per call off {off_us:.0}us, on \
         {on_us:.0}us, difference {:+.1}%",
        ms(off50),
        ms(off99),
        ms(on50),
        ms(on99),
        (on50.as_secs_f64() / off50.as_secs_f64() - 1.0) * 100.0,
        (on99.as_secs_f64() / off99.as_secs_f64() - 1.0) * 100.0,
        exports.load(Ordering::SeqCst),
        (on_us / off_us - 1.0) * 100.0,
    );
}

/// One round of the `throughput` figure: each phase's calls a second and CPU a call, in µs
/// (the server's and the bench's own; the direct callers' all the bench's).
struct ThroughputRound {
    direct: f64,
    direct_us: f64,
    followed: f64,
    followed_us: (f64, f64),
    unfollowed: f64,
    unfollowed_us: (f64, f64),
}

impl ThroughputRound {
    fn followed_ratio(&self) -> f64 {
        self.followed / self.direct
    }

    fn unfollowed_ratio(&self) -> f64 {
        self.unfollowed / self.direct
    }

    /// Calls per CPU-second of the runs not followed, against the direct callers'.
    fn per_cpu_ratio(&self) -> f64 {
        self.direct_us / (self.unfollowed_us.0 + self.unfollowed_us.1)
    }
}

/// The median of `values` (the mean of the middle two when their count is even) and their
/// least and greatest.
fn median_and_range(values: impl Iterator<Item = f64>) -> (f64, f64, f64) {
    let mut values: Vec<f64> = values.collect();
    values.sort_by(f64::total_cmp);
    let (Some(&least), Some(&greatest)) = (values.first(), values.last()) else {
        return (0.0, 0.0, 0.0);
    };
    let middle = values.len() / 2;
    let median = if values.len().is_multiple_of(2) {
        (values[middle - 1] + values[middle]) / 2.0
    } else {
        values[middle]
    };
    (median, least, greatest)
}

async fn figure_throughput(backend: &str, base: &Option<String>) {
    let at_once = env_number("WOR_BENCH_AT_ONCE", 32).max(1);
    let per_run = env_number("WOR_BENCH_CALLS_PER_RUN", 50);
    let takes = env_number("WOR_BENCH_TOOL_MS", 0);
    let rounds = env_number("WOR_BENCH_THROUGHPUT_ROUNDS", 3).max(1);
    let echo = Echo {
        takes: Duration::from_millis(takes as u64),
        ..Echo::default()
    };
    let addr = serve_echo(echo.clone()).await;
    let http = client();
    let (server, key) = Server::start(
        database_for(base).await.as_deref(),
        // As many runs at once as there are callers: the project's limit and the process's
        // pool both allow them.
        &format!("max_running_per_project = {at_once}\nworkers = {at_once}\n{LOOPBACK_CONFIG}"),
    );
    let api = Api::new(&server, key);
    api.mcp_tools("echo", addr, &["echo"]).await;
    // Each run stops after its budget of calls: the answers' numbers are shared by all runs.
    let routine = api
        .apply(&echo_routine("many", per_run).replace(
            &format!("when = {{ last_tool_result_contains = \"#{per_run}#\" }}"),
            "when = { last_tool_result_contains = \"#never#\" }",
        ))
        .await;
    // The server's CPU and the bench's own so far, and what each used since such a reading.
    let cpu_now = || (server.cpu_time(), process_cpu_time("self"));
    let cpu_since = |(server_at, bench_at): (Duration, Duration)| {
        let (server_now, bench_now) = cpu_now();
        (
            server_now.saturating_sub(server_at),
            bench_now.saturating_sub(bench_at),
        )
    };
    // CPU a call in µs, of the server's and of the bench's process.
    let per_call = |cpu: Duration, calls: usize| cpu.as_secs_f64() * 1e6 / calls.max(1) as f64;
    let both_per_call = |(server_cpu, bench_cpu): (Duration, Duration), calls: usize| {
        (per_call(server_cpu, calls), per_call(bench_cpu, calls))
    };
    // Starts `at_once` runs of the routine together, each followed to its end when `follow`,
    // and returns their ids once every start (and follow) has returned.
    let start_all = async |follow: bool| {
        let starts: Vec<_> = (0..at_once)
            .map(|_| {
                let (api, routine) = (api.clone(), routine.clone());
                tokio::spawn(async move {
                    if follow {
                        start_and_follow(&api, &routine).await
                    } else {
                        start_run(&api, &routine).await
                    }
                })
            })
            .collect();
        let mut ids = Vec::with_capacity(at_once);
        for start in starts {
            ids.push(start.await.unwrap());
        }
        ids
    };
    let expected = at_once * per_run;
    let deadline = Duration::from_secs(300);
    // The host's speed drifts over seconds: each round measures the direct callers and both
    // halves of the runs one after the other, and the figure is each ratio's median over the
    // rounds, each ratio taken within its round.
    let mut measured = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        // What the server does after the last round's runs ended (its log's checkpoints)
        // settles before the direct callers share the cores with it.
        tokio::time::sleep(Duration::from_secs(1)).await;
        echo.calls.store(0, Ordering::SeqCst);
        let bench_cpu = process_cpu_time("self");
        let started = Instant::now();
        let callers: Vec<_> = (0..at_once)
            .map(|_| {
                let http = http.clone();
                tokio::spawn(async move {
                    for _ in 0..per_run {
                        direct_call(&http, addr).await;
                    }
                })
            })
            .collect();
        for caller in callers {
            caller.await.unwrap();
        }
        let direct = expected as f64 / started.elapsed().as_secs_f64();
        // The direct callers and the tool server share the bench's process.
        let direct_us = per_call(process_cpu_time("self").saturating_sub(bench_cpu), expected);

        echo.calls.store(0, Ordering::SeqCst);
        let cpu = cpu_now();
        let started = Instant::now();
        start_all(true).await;
        let made = echo.calls.load(Ordering::SeqCst);
        assert_eq!(
            made, expected,
            "the followed runs made {made} of {expected} calls"
        );
        let followed = made as f64 / started.elapsed().as_secs_f64();
        let followed_us = both_per_call(cpu_since(cpu), made);

        // The same runs again, started without a watcher: what following each run's events
        // costs the server, which shares the cores with the runs. This half comes second, on a
        // server the first has warmed, so the difference is an upper bound. It ends, as the
        // first does, when every run has ended: once the tool server has had all their calls,
        // each run's status is read until it is final.
        echo.calls.store(0, Ordering::SeqCst);
        let cpu = cpu_now();
        let started = Instant::now();
        let mut pending = start_all(false).await;
        while echo.calls.load(Ordering::SeqCst) < expected {
            assert!(
                started.elapsed() < deadline,
                "the runs that no one follows made {} of {expected} calls in 300 s",
                echo.calls.load(Ordering::SeqCst)
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        while !pending.is_empty() {
            let mut still = Vec::new();
            for id in pending {
                let run = api.get(&format!("/v1/runs/{id}")).await;
                let status = run["status"].as_str().unwrap_or_default();
                if !["succeeded", "failed", "cancelled", "budget_exceeded"].contains(&status) {
                    still.push(id);
                }
            }
            pending = still;
            assert!(
                started.elapsed() < deadline,
                "{} runs that no one follows had not ended in 300 s",
                pending.len()
            );
            if !pending.is_empty() {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        let unfollowed = expected as f64 / started.elapsed().as_secs_f64();
        let unfollowed_us = both_per_call(cpu_since(cpu), expected);
        measured.push(ThroughputRound {
            direct,
            direct_us,
            followed,
            followed_us,
            unfollowed,
            unfollowed_us,
        });
    }
    let median =
        |figure: fn(&ThroughputRound) -> f64| median_and_range(measured.iter().map(figure)).0;
    let (followed_ratio, followed_least, followed_most) =
        median_and_range(measured.iter().map(ThroughputRound::followed_ratio));
    let (unfollowed_ratio, unfollowed_least, unfollowed_most) =
        median_and_range(measured.iter().map(ThroughputRound::unfollowed_ratio));
    let (per_cpu_ratio, per_cpu_least, per_cpu_most) =
        median_and_range(measured.iter().map(ThroughputRound::per_cpu_ratio));
    let tool = if takes == 0 {
        String::new()
    } else {
        format!(", each call taking the tool {takes} ms")
    };
    println!(
        "{backend:<8} throughput  {at_once} at once{tool}, medians of {rounds} rounds of {expected} \
         calls: direct {:.0} calls/s | through routines {:.0} calls/s | ratio {followed_ratio:.3}x \
         ({followed_least:.3}–{followed_most:.3}) | runs not followed {:.0} calls/s, ratio \
         {unfollowed_ratio:.3}x ({unfollowed_least:.3}–{unfollowed_most:.3}) | CPU a call: direct \
         {:.0}us, followed {:.0}us server + {:.0}us bench, not followed {:.0}us server + {:.0}us \
         bench | calls per CPU-second, not followed against direct: ratio {per_cpu_ratio:.3}x \
         ({per_cpu_least:.3}–{per_cpu_most:.3})",
        median(|round| round.direct),
        median(|round| round.followed),
        median(|round| round.unfollowed),
        median(|round| round.direct_us),
        median(|round| round.followed_us.0),
        median(|round| round.followed_us.1),
        median(|round| round.unfollowed_us.0),
        median(|round| round.unfollowed_us.1),
    );
}

async fn figure_trivial(backend: &str, base: &Option<String>) {
    let total = env_number("WOR_BENCH_TRIVIAL_RUNS", 200);
    for starters in [1usize, 8, 32] {
        // The pool has a slot for every starter's run (the default of 16 would queue half of
        // 32 starters' runs behind the others, whatever the engine's own latency).
        let (server, key) = Server::start(
            database_for(base).await.as_deref(),
            "max_running_per_project = 64\nworkers = 64\n",
        );
        let api = Api::new(&server, key);
        let routine = api.apply(TRIVIAL).await;
        start_and_follow(&api, &routine).await;
        let next = Arc::new(AtomicUsize::new(0));
        let started = Instant::now();
        let tasks: Vec<_> = (0..starters)
            .map(|_| {
                let (api, routine, next) = (api.clone(), routine.clone(), next.clone());
                tokio::spawn(async move {
                    let mut ids = Vec::new();
                    while next.fetch_add(1, Ordering::SeqCst) < total {
                        ids.push(start_and_follow(&api, &routine).await);
                    }
                    ids
                })
            })
            .collect();
        let mut ids = Vec::new();
        for task in tasks {
            ids.extend(task.await.unwrap());
        }
        let rate = ids.len() as f64 / started.elapsed().as_secs_f64();
        let mut waits = Vec::new();
        for id in &ids {
            let run = api.get(&format!("/v1/runs/{id}")).await;
            if let Some(wait) = between(&run, "created_at", "started_at") {
                waits.push(wait);
            }
        }
        waits.sort();
        println!(
            "{backend:<8} trivial     {starters:>2} starters: {rate:.1} runs/s ({} runs) | \
             enqueue→start p50={:.1}ms p99={:.1}ms",
            ids.len(),
            ms(percentile(&waits, 0.5)),
            ms(percentile(&waits, 0.99)),
        );
    }
}

async fn figure_cron(backend: &str, base: &Option<String>) {
    let count = env_number("WOR_BENCH_CRON_ROUTINES", 10_000);
    // `skip` (never full here: each routine allows 1,000 runs) makes every slot start at its
    // time, as before runs were recorded ahead of their slot; `queue` (the default) lets the
    // scheduler record them ahead.
    let overlap = std::env::var("WOR_BENCH_CRON_OVERLAP").unwrap_or_else(|_| "queue".to_owned());
    assert!(
        overlap == "queue" || overlap == "skip",
        "WOR_BENCH_CRON_OVERLAP is queue or skip"
    );
    // Baseline: as many rows inserted in one transaction, on the same kind of database.
    let baseline = {
        sqlx::any::install_default_drivers();
        let dir = tempfile::tempdir().unwrap();
        let url = match database_for(base).await {
            Some(url) => url,
            None => format!("sqlite://{}?mode=rwc", dir.path().join("b.db").display()),
        };
        let pool = sqlx::AnyPool::connect(&url).await.unwrap();
        sqlx::query(
            "CREATE TABLE slots (id BIGINT PRIMARY KEY, routine TEXT NOT NULL, at BIGINT NOT NULL)",
        )
        .execute(&pool)
        .await
        .unwrap();
        let started = Instant::now();
        #[expect(
            clippy::disallowed_methods,
            reason = "the baseline is a plain transaction on a database of its own, outside the store"
        )]
        let mut tx = pool.begin().await.unwrap();
        for i in 0..count {
            sqlx::query("INSERT INTO slots (id, routine, at) VALUES ($1, $2, $3)")
                .bind(i as i64)
                .bind(format!("rtn_{i}"))
                .bind(0_i64)
                .execute(&mut *tx)
                .await
                .unwrap();
        }
        tx.commit().await.unwrap();
        let took = started.elapsed();
        pool.close().await;
        took
    };

    let (server, key) = Server::start(
        database_for(base).await.as_deref(),
        "max_running_per_project = 64\n",
    );
    let api = Api::new(&server, key);
    let applied = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    let appliers: Vec<_> = (0..8)
        .map(|_| {
            let (api, next, overlap) = (api.clone(), next.clone(), overlap.clone());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= count {
                        return;
                    }
                    api.apply(&format!(
                        "{}overlap = \"{overlap}\"\n[schedule]\ncron = \"* * * * *\"\n",
                        TRIVIAL.replace("name = \"trivial\"", &format!("name = \"cron-{i}\""))
                    ))
                    .await;
                }
            })
        })
        .collect();
    for applier in appliers {
        applier.await.unwrap();
    }
    let apply_took = applied.elapsed();
    // The first slot after every routine exists: the next minute boundary.
    let now = chrono::Utc::now();
    let slot = now
        .with_timezone(&chrono::Utc)
        .timestamp()
        .div_euclid(60)
        .saturating_add(1)
        * 60;
    let slot_at = chrono::DateTime::from_timestamp(slot, 0).unwrap();
    // Only the runs of this slot: a run of the next minute's slot (or, recorded ahead, of the
    // one after) is not one of them.
    let key = format!("slot:{}", slot * 1000);
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut runs: Vec<serde_json::Value> = Vec::new();
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_secs(2)).await;
        if chrono::Utc::now() < slot_at + chrono::Duration::seconds(2) {
            continue;
        }
        let mut all = Vec::new();
        for status in ["queued", "running", "succeeded", "failed"] {
            all.extend(api.runs_with_status(status).await);
        }
        // A run that moved on while the lists were read is in two of them: once each.
        let mut seen = std::collections::HashSet::new();
        runs = all
            .into_iter()
            .filter(|r| r["trigger"] == "schedule" && r["trigger_key"] == key.as_str())
            .filter(|r| seen.insert(r["id"].as_str().unwrap_or_default().to_owned()))
            .collect();
        if runs.len() >= count || chrono::Utc::now() > slot_at + chrono::Duration::seconds(60) {
            break;
        }
    }
    let at = |run: &serde_json::Value, field: &str| {
        run[field]
            .as_str()
            .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
            .map(|t| (t - slot_at.fixed_offset()).num_milliseconds())
    };
    // When each run was recorded, from the slot (negative: ahead of it). A run recorded ahead
    // is claimable from its slot on, so it counts as dispatched at the slot.
    let recorded: Vec<i64> = runs.iter().filter_map(|r| at(r, "created_at")).collect();
    let ahead = recorded.iter().filter(|ms| **ms < 0).count();
    let (earliest, latest) = (
        recorded.iter().copied().min().unwrap_or(0),
        recorded.iter().copied().max().unwrap_or(0),
    );
    let mut lags: Vec<Duration> = recorded
        .iter()
        .map(|ms| Duration::from_millis(u64::try_from(*ms).unwrap_or(0)))
        .collect();
    lags.sort();
    let within_1s = lags
        .iter()
        .filter(|l| **l <= Duration::from_secs(1))
        .count();
    // No run of the slot may start before it.
    let started: Vec<i64> = runs.iter().filter_map(|r| at(r, "started_at")).collect();
    let early = started.iter().filter(|ms| **ms < 0).count();
    assert_eq!(early, 0, "{early} runs of the slot started before it");
    println!(
        "{backend:<8} cron        {count} routines (overlap {overlap}) due in one slot: baseline {count} inserts in \
         one transaction {:.0}ms | dispatched {}/{count}, p50={:.0}ms p99={:.0}ms, {within_1s} \
         within 1 s; {ahead} recorded ahead, from {earliest}ms to {latest:+}ms of the slot; first \
         claimed at {:+}ms, none before the slot (applying them took {:.1}s, the last {}s \
         before the slot)",
        ms(baseline),
        lags.len(),
        ms(percentile(&lags, 0.5)),
        ms(percentile(&lags, 0.99)),
        started.iter().copied().min().unwrap_or(0),
        apply_took.as_secs_f64(),
        slot - now.timestamp(),
    );
}

async fn figure_parked(backend: &str, base: &Option<String>) {
    let parked = env_number("WOR_BENCH_PARKED", 1000);
    let echo = Echo::default();
    let addr = serve_echo(echo.clone()).await;
    let (server, key) = Server::start(
        database_for(base).await.as_deref(),
        &format!("max_running_per_project = 64\n{LOOPBACK_CONFIG}"),
    );
    let api = Api::new(&server, key);
    api.mcp_tools("echo", addr, &[]).await;
    let routine = api
        .apply(
            &echo_routine("held", 1)
                .replace("mode = \"auto\"", "mode = \"confirm\"")
                .replace("max_runs = 64", "max_runs = 100000"),
        )
        .await;
    let start_latency = |api: Api, routine: String| async move {
        let mut times = Vec::new();
        for _ in 0..30 {
            let started = Instant::now();
            start_run(&api, &routine).await;
            times.push(started.elapsed());
        }
        times.sort();
        percentile(&times, 0.5)
    };
    let wait_parked = |api: Api, at_least: usize| async move {
        let deadline = Instant::now() + Duration::from_secs(1800);
        loop {
            let queued = api.get("/v1/runs?status=queued&limit=1").await;
            let running = api.get("/v1/runs?status=running&limit=1").await;
            if queued.as_array().is_some_and(Vec::is_empty)
                && running.as_array().is_some_and(Vec::is_empty)
            {
                let waiting = api.runs_with_status("waiting_for_approval").await.len();
                if waiting >= at_least {
                    return waiting;
                }
            }
            assert!(Instant::now() < deadline, "runs did not park in time");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    let empty_start = start_latency(api.clone(), routine.clone()).await;
    wait_parked(api.clone(), 30).await;
    let rss_before = server.rss_kib();
    let data_before = server.data_kib();
    let next = Arc::new(AtomicUsize::new(0));
    let starters: Vec<_> = (0..16)
        .map(|_| {
            let (api, routine, next) = (api.clone(), routine.clone(), next.clone());
            tokio::spawn(async move {
                while next.fetch_add(1, Ordering::SeqCst) < parked {
                    start_run(&api, &routine).await;
                }
            })
        })
        .collect();
    for starter in starters {
        starter.await.unwrap();
    }
    let waiting = wait_parked(api.clone(), parked + 30).await;
    let rss_after = server.rss_kib();
    let data_after = server.data_kib();
    let full_start = start_latency(api.clone(), routine.clone()).await;
    println!(
        "{backend:<8} parked      {waiting} runs waiting for approval: server memory {:.2} KB \
         per parked run (RSS {rss_before} → {rss_after} KiB) | start with 30 parked p50={:.1}ms, \
         with {waiting} parked p50={:.1}ms | data dir {:.2} KB per parked run",
        (rss_after.saturating_sub(rss_before)) as f64 * 1.024 / parked as f64,
        ms(empty_start),
        ms(full_start),
        (data_after.saturating_sub(data_before)) as f64 * 1.024 / parked as f64,
    );
}

#[tokio::main]
async fn main() {
    let only = std::env::var("WOR_BENCH_ONLY").unwrap_or_default();
    let wanted = |name: &str| only.is_empty() || only.split(',').any(|o| o.trim() == name);
    for (backend, base) in backends() {
        if wanted("call") {
            figure_call(backend, &base).await;
        }
        if wanted("observed") {
            figure_observed(backend, &base).await;
        }
        if wanted("throughput") {
            figure_throughput(backend, &base).await;
        }
        if wanted("trivial") {
            figure_trivial(backend, &base).await;
        }
        if wanted("parked") {
            figure_parked(backend, &base).await;
        }
        if wanted("cron") {
            figure_cron(backend, &base).await;
        }
        drop_fresh_databases(&base).await;
    }
}
