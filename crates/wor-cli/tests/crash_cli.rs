//! The crash test: `wor serve` killed with SIGKILL at random points, at least 30 times, while
//! runs call a read-only tool and a consequential tool a person approves, restarted each time
//! on the same data. Afterwards, with the server left to finish: every run has ended (or waits
//! for a person), no call ran twice unless a person approved re-running it after its outcome
//! was lost (`outcome_unknown`, docs/approvals.md), no consequential call ran without an
//! approval, no approval was lost, and the audit chain verifies.
//!
//! The tool server is the test's own (MCP over streamable HTTP on loopback): it counts every
//! execution of every call, each call told apart by a unique argument, so a repeated or a
//! missing execution shows. The seed of the kill schedule is printed and can be set with
//! `WOR_CRASH_SEED` to replay a schedule.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

mod common;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use rmcp::ServerHandler;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ErrorData,
    InitializeResult, ListToolsResult, PaginatedRequestParams, ServerCapabilities, Tool,
};
use rmcp::service::{RequestContext, RoleServer};
use serde_json::{Value, json};

use common::{
    Server, create_project, create_token, database_args, enroll, run, serve_mcp, text, wor,
};

/// Kills of `wor serve`; the issue asks for at least 30.
const KILLS: usize = 32;
/// Runs started, two in each of the first incarnations of the server.
const RUNS_PER_INCARNATION: usize = 2;
const INCARNATIONS_STARTING_RUNS: usize = 18;
/// How long one incarnation lives before its SIGKILL, in milliseconds after it listens.
const UPTIME_MS: std::ops::Range<u64> = 200..2500;
/// How long the last incarnation has to finish everything. Runs whose worker was killed wait
/// for their lease ([`LEASE`]) to run out before another worker resumes them.
const SETTLE: Duration = Duration::from_secs(150);
/// The shortest lease a configuration may set: a killed incarnation's runs are resumed after
/// it, and the runs of a live one are renewed often, as under a slow disk.
const LEASE: &str = "lease_seconds = 5\n";
const DEFAULT_SEED: u64 = 0x5eed_0016;

/// Reads a record (`q`), then sends (`to`, needs a person's approval), then reads again. Each
/// argument comes from the run's input (`FIRST:`, `SEND:`, `SECOND:`), unique per run. A call
/// that did not go through (denied, or its outcome unknown and not retried) ends the run.
const ROUTINE: &str = r#"
name = "crash-desk"
instructions = "Look the record up, send it, then look it up again."

[concurrency]
max_runs = 16
overlap = "queue"

[model]
provider = "replay"
model = "script"

[[model.script.turns]]
when = { last_tool_result_contains = "FOUND-second" }
text = "Done."

[[model.script.turns]]
when = { last_tool_result_contains = "SENT-" }
tool_calls = [{ name = "desk__lookup", arguments_after = "SECOND:" }]

[[model.script.turns]]
when = { last_tool_result_contains = "FOUND-first" }
tool_calls = [{ name = "desk__send", arguments_after = "SEND:" }]

[[model.script.turns]]
tool_calls = [{ name = "desk__lookup", arguments_after = "FIRST:" }]

[[model.script.turns]]
text = "Stopped: a call did not go through."

[[tools]]
tool = "desk/lookup"
mode = "auto"

[[tools]]
tool = "desk/send"
mode = "confirm"
"#;

// ---------------------------------------------------------------------------------------------
// The tool server: every execution is recorded with a global sequence number when it arrives
// (its effect happens then), and answered after a delay, so a kill can land mid-call.

#[derive(Debug, Clone)]
struct Execution {
    /// `lookup` or `send`.
    tool: String,
    /// The call's unique argument (`q` or `to`).
    key: String,
    seq: u64,
}

#[derive(Debug, Default)]
struct DeskState {
    seq: AtomicU64,
    executions: Mutex<Vec<Execution>>,
}

#[derive(Debug, Clone, Default)]
struct Desk {
    state: Arc<DeskState>,
}

fn desk_tool(name: &'static str, description: &'static str, property: &str) -> Tool {
    let schema = json!({"type": "object", "properties": {property: {"type": "string"}},
        "required": [property]});
    Tool::new(
        name,
        description,
        Arc::new(schema.as_object().unwrap().clone()),
    )
}

/// A small stable hash (FNV-1a) for deterministic delays and decisions.
fn fnv(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

impl ServerHandler for Desk {
    fn get_info(&self) -> InitializeResult {
        InitializeResult::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(vec![
            desk_tool("lookup", "Looks a record up", "q"),
            desk_tool("send", "Sends the record to someone", "to"),
        ]))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let arguments = request.arguments.clone().unwrap_or_default();
        let property = if request.name == "send" { "to" } else { "q" };
        let key = arguments
            .get(property)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let seq = self.state.seq.fetch_add(1, Ordering::SeqCst) + 1;
        self.state.executions.lock().unwrap().push(Execution {
            tool: request.name.to_string(),
            key: key.clone(),
            seq,
        });
        tokio::time::sleep(Duration::from_millis(20 + fnv(&key) % 280)).await;
        let answer = match request.name.as_ref() {
            "send" => format!("SENT-{key}"),
            _ => format!("FOUND-{key}"),
        };
        Ok(CallToolResult::success(vec![ContentBlock::text(answer)]).into())
    }
}

// ---------------------------------------------------------------------------------------------
// The API, reached through whichever incarnation of the server is up.

#[derive(Clone)]
struct Api {
    runtime: tokio::runtime::Handle,
    http: reqwest::Client,
    /// The current server's URL; `None` while it is down.
    base: Arc<Mutex<Option<String>>>,
}

impl Api {
    fn new(runtime: tokio::runtime::Handle) -> Self {
        #[expect(
            clippy::disallowed_methods,
            reason = "the test talks to its own server on loopback"
        )]
        let http = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(Duration::from_secs(2))
            .timeout(Duration::from_secs(15))
            .build()
            .unwrap();
        Api {
            runtime,
            http,
            base: Arc::new(Mutex::new(None)),
        }
    }

    fn set_base(&self, base: Option<String>) {
        *self.base.lock().unwrap() = base;
    }

    /// One request; `Err` when the server is down or went down while answering.
    fn try_call(
        &self,
        key: &str,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(u16, Value), String> {
        let base = self
            .base
            .lock()
            .unwrap()
            .clone()
            .ok_or("the server is down")?;
        let mut request = self
            .http
            .request(method, format!("{base}{path}"))
            .bearer_auth(key);
        if let Some(body) = body {
            request = request.json(body);
        }
        self.runtime.block_on(async move {
            let response = request.send().await.map_err(|e| e.to_string())?;
            let status = response.status().as_u16();
            let bytes = response.bytes().await.map_err(|e| e.to_string())?;
            Ok((
                status,
                serde_json::from_slice(&bytes).unwrap_or(Value::Null),
            ))
        })
    }

    /// A request that must succeed with `expected` (the server is up and not being killed).
    fn call(
        &self,
        key: &str,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
        expected: u16,
    ) -> Value {
        let (status, answer) = self
            .try_call(key, method.clone(), path, body)
            .unwrap_or_else(|e| panic!("{method} {path} failed: {e}"));
        assert_eq!(status, expected, "{method} {path}: {answer}");
        answer
    }

    /// Every item of a list route, following `before` pages; `Err` names a failed page.
    fn try_list_all(&self, key: &str, path: &str) -> Result<Vec<Value>, String> {
        let mut all: Vec<Value> = Vec::new();
        loop {
            let mut page_path = format!("{path}limit=200");
            if let Some(last) = all.last() {
                page_path.push_str(&format!("&before={}", last["id"].as_str().unwrap()));
            }
            let page = match self.try_call(key, reqwest::Method::GET, &page_path, None)? {
                (200, Value::Array(page)) => page,
                (status, body) => return Err(format!("GET {page_path} answered {status}: {body}")),
            };
            let done = page.len() < 200;
            all.extend(page);
            if done {
                return Ok(all);
            }
        }
    }

    /// [`Self::try_list_all`] tried a few times, for the final look with the server up.
    fn list_all(&self, key: &str, path: &str) -> Vec<Value> {
        let mut last = String::new();
        for _ in 0..10 {
            match self.try_list_all(key, path) {
                Ok(all) => return all,
                Err(error) => last = error,
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        panic!("listing {path} failed ten times: {last}");
    }
}

impl Api {
    /// Every entry of the caller's project's audit chain, in order.
    fn audit_entries(&self, key: &str) -> Vec<Value> {
        let mut entries = Vec::new();
        let mut after = 0;
        loop {
            let path = format!("/v1/audit?after={after}&limit=500");
            let page = self.call(key, reqwest::Method::GET, &path, None, 200);
            entries.extend(page["entries"].as_array().unwrap().iter().cloned());
            match page["next_after"].as_i64() {
                Some(next) => after = next,
                None => return entries,
            }
        }
    }
}

/// Every run has exactly one `run.start` entry, and every approval a person decided exactly one
/// `approval.decide` (any other, none): a kill between a change and its entry loses neither.
fn entry_problems(entries: &[Value], runs: &[Value], approvals: &[Value]) -> Vec<String> {
    let count = |category: &str, subject: &str, id: &str| {
        entries
            .iter()
            .filter(|e| e["category"] == category && e["subjects"][subject] == id)
            .count()
    };
    let mut problems = Vec::new();
    for run in runs {
        let id = run["id"].as_str().unwrap();
        let starts = count("run.start", "run_id", id);
        if starts != 1 {
            problems.push(format!("run {id} has {starts} run.start entries, not one"));
        }
    }
    for approval in approvals {
        let id = approval["id"].as_str().unwrap();
        let decided = matches!(approval["status"].as_str(), Some("approved" | "denied"));
        let decisions = count("approval.decide", "approval_id", id);
        if decisions != usize::from(decided) {
            problems.push(format!(
                "approval {id} ({}) has {decisions} approval.decide entries",
                approval["status"]
            ));
        }
    }
    problems
}

// ---------------------------------------------------------------------------------------------
// The approver: a person deciding every pending approval as it appears, whichever server is
// up. Policy approvals are approved except one in eight; re-running a call whose outcome is
// unknown is approved two times in three. Decisions depend only on the call, not on timing.

#[derive(Debug, Clone)]
struct Decision {
    approve: bool,
    /// The tool server's sequence number when the decision was first sent: an execution the
    /// approval caused comes after it.
    seq_before: u64,
}

fn decide_to_approve(approval: &Value) -> bool {
    let key = call_key(approval);
    match approval["kind"].as_str().unwrap() {
        "outcome_unknown" => !fnv(&format!("unknown {key}")).is_multiple_of(3),
        _ => !fnv(&format!("policy {key}")).is_multiple_of(8),
    }
}

/// The unique argument of the call an approval is for.
fn call_key(approval: &Value) -> String {
    let arguments = &approval["arguments"];
    arguments["to"]
        .as_str()
        .or_else(|| arguments["q"].as_str())
        .unwrap_or_default()
        .to_owned()
}

fn spawn_approver(
    api: Api,
    key: String,
    desk: Arc<DeskState>,
    decisions: Arc<Mutex<BTreeMap<String, Decision>>>,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        while !stop.load(Ordering::SeqCst) {
            if let Ok((200, pending)) = api.try_call(
                &key,
                reqwest::Method::GET,
                "/v1/approvals?status=pending&limit=200",
                None,
            ) {
                for approval in pending.as_array().into_iter().flatten() {
                    let id = approval["id"].as_str().unwrap().to_owned();
                    let decision = decisions
                        .lock()
                        .unwrap()
                        .entry(id.clone())
                        .or_insert_with(|| Decision {
                            approve: decide_to_approve(approval),
                            seq_before: desk.seq.load(Ordering::SeqCst),
                        })
                        .clone();
                    let verb = if decision.approve { "approve" } else { "deny" };
                    // Down, killed mid-request or already decided (409): looked at again later.
                    let _ = api.try_call(
                        &key,
                        reqwest::Method::POST,
                        &format!("/v1/approvals/{id}/{verb}"),
                        Some(&json!({"reason": "crash test decision"})),
                    );
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    })
}

// ---------------------------------------------------------------------------------------------

fn input_for(token: &str) -> String {
    format!(
        r#"FIRST:{{"q":"first-{token}"}} SEND:{{"to":"{token}"}} SECOND:{{"q":"second-{token}"}}"#
    )
}

fn is_terminal(status: &str) -> bool {
    matches!(
        status,
        "succeeded" | "failed" | "cancelled" | "budget_exceeded" | "skipped"
    )
}

/// Lines of the servers' logs worth showing next to a failure.
/// The processes' notable lines ([`notable_log_lines`], the last 20) and their requests
/// that took a second or more (a worker's claim, which waits for a run, aside), for a
/// failure's message.
fn log_report(logs: &[Arc<Mutex<String>>]) -> String {
    let notable = notable_log_lines(logs);
    let mut lines: Vec<String> = notable
        .get(notable.len().saturating_sub(20)..)
        .unwrap_or_default()
        .to_vec();
    for log in logs {
        for line in log.lock().unwrap().lines() {
            let took = line
                .split_once("\"duration_us\":")
                .and_then(|(_, rest)| rest.split(|c: char| !c.is_ascii_digit()).next())
                .and_then(|digits| digits.parse::<u64>().ok());
            if took.is_some_and(|us| us >= 1_000_000) && !line.contains("/runs/claim") {
                lines.push(line.to_owned());
            }
        }
    }
    if lines.is_empty() {
        "nothing".to_owned()
    } else {
        lines.join("\n  ")
    }
}

fn notable_log_lines(logs: &[Arc<Mutex<String>>]) -> Vec<String> {
    let mut lines = Vec::new();
    for log in logs {
        for line in log.lock().unwrap().lines() {
            let lower = line.to_ascii_lowercase();
            if lower.contains("\"level\":\"error\"")
                || lower.contains("\"level\":\"warn\"")
                || lower.contains("panicked")
                || lower.contains("database is locked")
            {
                lines.push(line.to_owned());
            }
        }
    }
    lines
}

/// Adds the approver (a member other than the owner, whose key starts the runs), connects and
/// enables the tool server (`lookup` read-only) and applies the routine. Returns the
/// approver's key and the routine's id.
fn set_up(api: &Api, owner: &str, desk_addr: SocketAddr) -> (String, String) {
    let member = api.call(
        owner,
        reqwest::Method::POST,
        "/v1/members",
        Some(&json!({"name": "crash-approver", "role": "approver"})),
        201,
    );
    let approver = member["key"]["api_key"].as_str().unwrap().to_owned();
    let connection = api.call(
        owner,
        reqwest::Method::POST,
        "/v1/tool-connections",
        Some(&json!({"name": "desk", "kind": "mcp_http",
            "url": format!("http://{desk_addr}/mcp"), "allowlist": [desk_addr.to_string()]})),
        201,
    );
    let connection = connection["id"].as_str().unwrap().to_owned();
    let review = api.call(
        owner,
        reqwest::Method::GET,
        &format!("/v1/tool-connections/{connection}/review"),
        None,
        200,
    );
    let hashes: BTreeMap<String, String> = review["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["name"].as_str().unwrap().to_owned(),
                t["hash"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    api.call(
        owner,
        reqwest::Method::POST,
        &format!("/v1/tool-connections/{connection}/enable"),
        Some(&json!({"tools": hashes, "read_only": ["lookup"]})),
        200,
    );
    let applied = api.call(
        owner,
        reqwest::Method::POST,
        "/v1/routines",
        Some(&json!({"toml": ROUTINE})),
        201,
    );
    let routine = applied["routine"]["id"].as_str().unwrap().to_owned();

    (approver, routine)
}

/// Every run has ended, or waits on a pending approval; none failed.
fn run_problems(runs: &[Value], approvals: &[Value]) -> Vec<String> {
    let mut problems = Vec::new();
    // A run that waits for a person is acceptable only with a pending approval to decide.
    let pending_runs: Vec<&str> = approvals
        .iter()
        .filter(|a| a["status"] == "pending")
        .map(|a| a["run_id"].as_str().unwrap())
        .collect();
    for run in runs {
        let status = run["status"].as_str().unwrap();
        let id = run["id"].as_str().unwrap();
        let parked = status == "waiting_for_approval" && pending_runs.contains(&id);
        if !is_terminal(status) && !parked {
            problems.push(format!(
                "run {id} is still `{status}` {:.0?} after the last kill (neither ended nor \
                 parked on a pending approval)",
                SETTLE
            ));
        }
        // Every call either ran, was denied or had its lost outcome decided: the script always
        // has a turn left, so only a broken resumption fails a run.
        if status == "failed" {
            problems.push(format!(
                "run {id} failed: {}",
                run["outcome"].as_str().unwrap_or("(no outcome)")
            ));
        }
    }
    problems
}

/// Per call (told apart by its unique argument): no more executions than its approvals allow,
/// and no approved approval without an execution after it or an `outcome_unknown` approval
/// following it.
fn call_problems(
    executions: &[Execution],
    approvals: &[Value],
    decisions: &BTreeMap<String, Decision>,
) -> Vec<String> {
    let mut problems = Vec::new();
    let mut executed: HashMap<(String, String), Vec<u64>> = HashMap::new();
    for e in executions {
        executed
            .entry((e.tool.clone(), e.key.clone()))
            .or_default()
            .push(e.seq);
    }
    let mut approvals_of: HashMap<(String, String), Vec<&Value>> = HashMap::new();
    for approval in approvals {
        let tool = approval["tool"]
            .as_str()
            .unwrap()
            .trim_start_matches("desk/")
            .to_owned();
        approvals_of
            .entry((tool, call_key(approval)))
            .or_default()
            .push(approval);
    }
    for list in approvals_of.values_mut() {
        // Ids are time-ordered: oldest first.
        list.sort_by_key(|a| a["id"].as_str().unwrap().to_owned());
    }
    let no_approvals = Vec::new();
    for ((tool, key), seqs) in &executed {
        let approvals = approvals_of
            .get(&(tool.clone(), key.clone()))
            .unwrap_or(&no_approvals);
        let approved = |kind: &str| {
            approvals
                .iter()
                .filter(|a| a["kind"] == kind && a["status"] == "approved")
                .count()
        };
        let (policy, unknown) = (approved("policy"), approved("outcome_unknown"));
        let allowed = if tool == "send" {
            // A consequential call runs only with an approval, once per approval.
            (policy + unknown).min(1 + unknown)
        } else {
            1 + unknown
        };
        if seqs.len() > allowed {
            problems.push(format!(
                "`{tool}` with `{key}` executed {} times, but it had {policy} approved policy \
                 approval(s) and {unknown} approved outcome_unknown approval(s), which allow {allowed}",
                seqs.len()
            ));
        }
    }
    for ((tool, key), approvals) in &approvals_of {
        let seqs = executed
            .get(&(tool.clone(), key.clone()))
            .cloned()
            .unwrap_or_default();
        for (index, approval) in approvals.iter().enumerate() {
            if approval["status"] != "approved" {
                continue;
            }
            let id = approval["id"].as_str().unwrap();
            let kind = approval["kind"].as_str().unwrap();
            let Some(decision) = decisions.get(id) else {
                problems.push(format!(
                    "approval {id} ({kind}) of `{tool}` with `{key}` is approved, but the test \
                     never decided it"
                ));
                continue;
            };
            if !decision.approve {
                problems.push(format!(
                    "approval {id} ({kind}) of `{tool}` with `{key}` is approved, but the test \
                     denied it"
                ));
                continue;
            }
            let ran_after = seqs.iter().any(|&seq| seq > decision.seq_before);
            let unknown_after = approvals
                .get(index + 1..)
                .unwrap_or_default()
                .iter()
                .any(|later| later["kind"] == "outcome_unknown");
            if !ran_after && !unknown_after {
                problems.push(format!(
                    "approval {id} ({kind}) of `{tool}` with `{key}` was approved (used at {}), \
                     but the call never executed afterwards and no outcome_unknown approval \
                     followed: the approval was lost",
                    approval["used_at"].as_str().unwrap_or("never")
                ));
            }
        }
    }

    problems
}

/// The seed of a crash test: `WOR_CRASH_SEED`, else the default.
fn crash_seed() -> u64 {
    std::env::var("WOR_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_SEED)
}

/// A runtime of two threads with the desk served on it.
fn desk_runtime() -> (tokio::runtime::Runtime, Desk, SocketAddr) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let desk = Desk::default();
    let desk_addr = runtime.block_on(serve_mcp(desk.clone()));
    (runtime, desk, desk_addr)
}

/// Waits up to [`SETTLE`] until `expected` runs of `routine` (any number, for `None`) exist and
/// all have ended; what went wrong listing them meanwhile.
fn settle(api: &Api, owner: &str, routine: &str, expected: Option<usize>) -> Vec<String> {
    let settle_deadline = Instant::now() + SETTLE;
    let runs_path = format!("/v1/runs?routine_id={routine}&");
    let mut list_failures = Vec::new();
    while Instant::now() < settle_deadline {
        match api.try_list_all(owner, &runs_path) {
            Ok(runs)
                if expected.is_none_or(|n| runs.len() == n)
                    && runs
                        .iter()
                        .all(|r| is_terminal(r["status"].as_str().unwrap())) =>
            {
                break;
            }
            Ok(_) => {}
            // The server is up and nothing is being killed: an error answer is a finding.
            Err(error) => list_failures.push(format!("while settling, {error}")),
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    list_failures
}

/// `wor audit verify` on `db`, with every server stopped: what it said when it failed.
fn audit_problem(db: &[String]) -> Option<String> {
    let mut verify = vec!["audit", "verify"];
    verify.extend(db.iter().map(String::as_str));
    let verified = run(&mut wor(&verify));
    (!verified.status.success()).then(|| {
        format!(
            "`wor audit verify` failed: {}{}",
            text(&verified.stdout),
            text(&verified.stderr)
        )
    })
}

#[test]
fn runs_survive_repeated_sigkill_of_the_server_without_lost_or_repeated_calls() {
    let started = Instant::now();
    let seed = crash_seed();
    eprintln!("crash test seed {seed} (set WOR_CRASH_SEED to replay)");
    let mut rng = StdRng::seed_from_u64(seed);
    let (runtime, desk, desk_addr) = desk_runtime();

    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("wor.toml");
    std::fs::write(
        &config,
        format!("{LEASE}[egress]\nallowed_cidrs = [\"127.0.0.1/32\"]\n"),
    )
    .unwrap();
    let mut db = database_args(dir.path());
    db.extend(["--config".to_owned(), config.display().to_string()]);
    let owner = create_project(&db);

    let api = Api::new(runtime.handle().clone());
    let mut logs = Vec::new();
    let mut server = Server::start(&db, &[]);
    logs.push(server.log.clone());
    api.set_base(Some(server.url.clone()));

    let (approver, routine) = set_up(&api, &owner, desk_addr);

    let decisions = Arc::new(Mutex::new(BTreeMap::new()));
    let stop_approver = Arc::new(AtomicBool::new(false));
    let approver_thread = spawn_approver(
        api.clone(),
        approver.clone(),
        desk.state.clone(),
        decisions.clone(),
        stop_approver.clone(),
    );

    // Kill, restart, repeat; runs are started at random moments of the first incarnations.
    let mut kills = 0;
    let mut start_attempts = 0;
    let mut starters = Vec::new();
    let mut exited_on_its_own = Vec::new();
    for incarnation in 0..KILLS {
        let uptime = Duration::from_millis(rng.random_range(UPTIME_MS));
        let alive_since = Instant::now();
        if incarnation < INCARNATIONS_STARTING_RUNS {
            let mut offsets: Vec<u64> = (0..RUNS_PER_INCARNATION)
                .map(|_| rng.random_range(0..uptime.as_millis() as u64))
                .collect();
            offsets.sort_unstable();
            for (n, offset) in offsets.into_iter().enumerate() {
                let at = alive_since + Duration::from_millis(offset);
                std::thread::sleep(at.saturating_duration_since(Instant::now()));
                let token = format!("k{incarnation:02}r{n}");
                start_attempts += 1;
                // In the background, so starts overlap each other, the approver and the kill.
                // Killed mid-request or not: the run, if it was created, is found by listing.
                let (api, owner, path) = (
                    api.clone(),
                    owner.clone(),
                    format!("/v1/routines/{routine}/runs"),
                );
                starters.push(std::thread::spawn(move || {
                    let _ = api.try_call(
                        &owner,
                        reqwest::Method::POST,
                        &path,
                        Some(&json!({"input": input_for(&token)})),
                    );
                }));
            }
        }
        std::thread::sleep((alive_since + uptime).saturating_duration_since(Instant::now()));
        api.set_base(None);
        // A server that ended on its own (a panic, an abort, a stack overflow) is a finding.
        if let Some(status) = server.child.try_wait().unwrap() {
            exited_on_its_own.push(format!(
                "incarnation {incarnation} of the server exited on its own with {status}"
            ));
        }
        server.child.kill().unwrap();
        server.child.wait().unwrap();
        kills += 1;
        server = Server::start(&db, &[]);
        logs.push(server.log.clone());
        api.set_base(Some(server.url.clone()));
    }
    let kill_phase = started.elapsed();
    for starter in starters {
        starter.join().unwrap();
    }

    // No more kills: everything should settle, the approver deciding what comes up.
    let list_failures = settle(&api, &owner, &routine, None);
    let runs_path = format!("/v1/runs?routine_id={routine}&");
    stop_approver.store(true, Ordering::SeqCst);
    approver_thread.join().unwrap();
    let settled = started.elapsed();
    let runs = api.list_all(&owner, &runs_path);
    let approvals = api.list_all(&owner, "/v1/approvals?");
    // An entry a kill left staged is appended by the next server's audit writer once its
    // grace (5 s) has passed: waited for, up to four times that.
    let entries_deadline = Instant::now() + Duration::from_secs(20);
    let missing_entries = loop {
        let found = entry_problems(&api.audit_entries(&owner), &runs, &approvals);
        if found.is_empty() || Instant::now() >= entries_deadline {
            break found;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    let mut problems: Vec<String> = exited_on_its_own;
    problems.extend(list_failures);
    problems.extend(run_problems(&runs, &approvals));
    problems.extend(missing_entries);
    server.stop();

    let executions = desk.state.executions.lock().unwrap().clone();
    let decisions = decisions.lock().unwrap().clone();
    problems.extend(call_problems(&executions, &approvals, &decisions));

    // The audit chain, with the server stopped.
    problems.extend(audit_problem(&db));

    let summary = format!(
        "seed {seed}; {kills} kills in {kill_phase:.1?}, settled at {settled:.1?}; {} runs \
         ({start_attempts} start attempts), {} executions, {} approvals ({} approved, {} \
         outcome_unknown)",
        runs.len(),
        executions.len(),
        approvals.len(),
        approvals
            .iter()
            .filter(|a| a["status"] == "approved")
            .count(),
        approvals
            .iter()
            .filter(|a| a["kind"] == "outcome_unknown")
            .count(),
    );
    eprintln!("crash test: {summary}");
    let mut statuses: BTreeMap<&str, usize> = BTreeMap::new();
    for run in &runs {
        *statuses.entry(run["status"].as_str().unwrap()).or_default() += 1;
    }
    eprintln!("crash test: run statuses {statuses:?}");
    let notable = notable_log_lines(&logs);
    // A kill is not an error: whatever a server logs as one is something that went wrong
    // under ordinary load (a store write refused, a step that failed).
    for line in notable.iter().filter(|l| l.contains("\"level\":\"ERROR\"")) {
        problems.push(format!("a server logged an error: {line}"));
    }
    eprintln!(
        "crash test: {} warning/error lines in the servers' logs, the first ones:\n  {}",
        notable.len(),
        notable
            .get(..notable.len().min(8))
            .unwrap_or_default()
            .join("\n  ")
    );
    assert!(kills >= 30, "only {kills} kills");
    // Not vacuous: runs ran, both tools executed, people approved.
    assert!(
        runs.len() >= 20,
        "only {} runs were started: {summary}",
        runs.len()
    );
    assert!(
        executions.iter().any(|e| e.tool == "send")
            && executions.iter().any(|e| e.tool == "lookup"),
        "both tools should have run: {summary}"
    );
    if !problems.is_empty() {
        let warnings: Vec<&String> = notable
            .iter()
            .filter(|l| !l.contains("\"level\":\"ERROR\""))
            .collect();
        let shown = warnings.len().min(20);
        panic!(
            "{} problem(s) after {kills} kills ({summary}):\n  {}\n\nrun statuses: {statuses:?}\n\
             {shown} of {} other warning lines of the servers' logs:\n  {}",
            problems.len(),
            problems.join("\n  "),
            warnings.len(),
            warnings
                .get(..shown)
                .unwrap_or_default()
                .iter()
                .map(|l| l.as_str())
                .collect::<Vec<_>>()
                .join("\n  ")
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The same desk, driven by remote workers: two `api` processes and a scheduler on one database,
// three `worker` processes (no database, no encryption key) killed with SIGKILL at random and
// started again, while a person decides what comes up.

/// Kills of a worker; the scale-out issue asks for at least 20.
const WORKER_KILLS: usize = 24;
/// Runs started, all at once, across the two `api` processes.
const WORKER_RUNS: usize = 300;
/// How long a worker lives between kills, in milliseconds.
const WORKER_UPTIME_MS: std::ops::Range<u64> = 300..1500;
/// How long a worker started again may take to start. It starts once its control plane has
/// answered its first heartbeat, which it asks again while the control plane does not answer
/// (each try waits up to 10 s); on a machine this busy a first try has timed out. A start
/// slower than [`SLOW_WORKER_START`] is reported with what the other processes logged.
const WORKER_START: Duration = Duration::from_secs(90);
const SLOW_WORKER_START: Duration = Duration::from_secs(10);

#[test]
fn runs_survive_repeated_sigkill_of_remote_workers_without_lost_or_repeated_calls() {
    let started = Instant::now();
    let seed = crash_seed();
    eprintln!("worker crash test seed {seed} (set WOR_CRASH_SEED to replay)");
    let mut rng = StdRng::seed_from_u64(seed);
    let (runtime, desk, desk_addr) = desk_runtime();

    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("wor.toml");
    let egress = "[egress]\nallowed_cidrs = [\"127.0.0.1/32\"]\n";
    std::fs::write(&config, format!("{LEASE}{egress}")).unwrap();
    let mut db = database_args(dir.path());
    db.extend(["--config".to_owned(), config.display().to_string()]);
    let owner = create_project(&db);
    let role = |role: &str| {
        let mut args = vec!["serve", "--listen", "127.0.0.1:0", "--role", role];
        args.extend(db.iter().map(String::as_str));
        Server::spawn(&args, "wor: listening on ")
    };
    let apis = [role("api"), role("api")];
    let scheduler = role("scheduler");
    let mut logs: Vec<Arc<Mutex<String>>> = apis.iter().map(|a| a.log.clone()).collect();
    logs.push(scheduler.log.clone());

    let api = Api::new(runtime.handle().clone());
    api.set_base(Some(apis[0].url.clone()));
    let other_api = Api::new(runtime.handle().clone());
    other_api.set_base(Some(apis[1].url.clone()));
    let (approver, routine) = set_up(&api, &owner, desk_addr);

    // Three workers, each enrolled on its own data dir, with the egress its runs need.
    let worker_config = dir.path().join("worker.toml");
    std::fs::write(&worker_config, egress).unwrap();
    let worker_dirs: Vec<std::path::PathBuf> = (0..3)
        .map(|n| {
            let data_dir = dir.path().join(format!("worker-{n}"));
            let enrolled = enroll(&apis[n % 2].url, &create_token(&db), &data_dir);
            assert!(enrolled.status.success(), "{}", text(&enrolled.stderr));
            data_dir
        })
        .collect();
    let mut workers: Vec<Server> = worker_dirs
        .iter()
        .map(|d| Server::worker(d, &worker_config))
        .collect();
    logs.extend(workers.iter().map(|w| w.log.clone()));

    let decisions = Arc::new(Mutex::new(BTreeMap::new()));
    let stop_approver = Arc::new(AtomicBool::new(false));
    let approver_thread = spawn_approver(
        other_api.clone(),
        approver.clone(),
        desk.state.clone(),
        decisions.clone(),
        stop_approver.clone(),
    );

    // Every run is started at once, half on each `api` process.
    let path = format!("/v1/routines/{routine}/runs");
    let starters: Vec<_> = (0..2)
        .map(|half| {
            let (api, owner, path) = (
                if half == 0 {
                    api.clone()
                } else {
                    other_api.clone()
                },
                owner.clone(),
                path.clone(),
            );
            std::thread::spawn(move || {
                for n in (half..WORKER_RUNS).step_by(2) {
                    api.call(
                        &owner,
                        reqwest::Method::POST,
                        &path,
                        Some(&json!({"input": input_for(&format!("w{n:03}"))})),
                        202,
                    );
                }
            })
        })
        .collect();

    // Kill a worker at random, start it again on its data dir, repeat.
    let mut exited_on_its_own = Vec::new();
    let mut slow_starts: Vec<String> = Vec::new();
    for kill in 0..WORKER_KILLS {
        std::thread::sleep(Duration::from_millis(rng.random_range(WORKER_UPTIME_MS)));
        let n = rng.random_range(0..workers.len());
        let worker = &mut workers[n];
        if let Some(status) = worker.child.try_wait().unwrap() {
            exited_on_its_own.push(format!(
                "worker {n} exited on its own with {status} before kill {kill}"
            ));
        }
        worker.child.kill().unwrap();
        worker.child.wait().unwrap();
        let starting = Instant::now();
        *worker = Server::try_worker(&worker_dirs[n], &worker_config, WORKER_START).unwrap_or_else(
            |why| {
                panic!(
                    "{why}\n\nwhat the other processes logged of note:\n  {}",
                    log_report(&logs)
                )
            },
        );
        let took = starting.elapsed();
        if took > SLOW_WORKER_START {
            slow_starts.push(format!(
                "worker {n} took {took:.1?} to start at kill {kill}"
            ));
            eprintln!(
                "worker {n} took {took:.1?} to start; what the other processes logged of note:\n  {}",
                log_report(&logs)
            );
        }
        logs.push(worker.log.clone());
    }
    let kill_phase = started.elapsed();
    for starter in starters {
        starter.join().unwrap();
    }

    let list_failures = settle(&api, &owner, &routine, Some(WORKER_RUNS));
    let runs_path = format!("/v1/runs?routine_id={routine}&");
    stop_approver.store(true, Ordering::SeqCst);
    approver_thread.join().unwrap();
    let settled = started.elapsed();
    let runs = api.list_all(&owner, &runs_path);
    let approvals = api.list_all(&owner, "/v1/approvals?");
    let mut problems: Vec<String> = exited_on_its_own;
    problems.extend(list_failures);
    problems.extend(run_problems(&runs, &approvals));
    // A run that did not finish its work is one a person stopped: every call went through
    // unless an approval of the run was denied.
    for run in runs.iter().filter(|r| r["status"] == "succeeded") {
        let denied = approvals
            .iter()
            .any(|a| a["run_id"] == run["id"] && a["status"] == "denied");
        if run["outcome"] != "Done." && !denied {
            problems.push(format!(
                "run {} ended `{}` with no denied approval: a call did not go through",
                run["id"], run["outcome"]
            ));
        }
    }
    for worker in workers {
        worker.stop();
    }
    // A killed worker's scratch directory goes when the worker starts again on its data dir,
    // and a stopped worker's when it stops.
    for data_dir in &worker_dirs {
        let left: Vec<String> = std::fs::read_dir(data_dir)
            .unwrap()
            .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name.starts_with("scratch-"))
            .collect();
        if !left.is_empty() {
            problems.push(format!("{} still holds {left:?}", data_dir.display()));
        }
    }
    scheduler.stop();
    for api in apis {
        api.stop();
    }
    let executions = desk.state.executions.lock().unwrap().clone();
    let decisions = decisions.lock().unwrap().clone();
    problems.extend(call_problems(&executions, &approvals, &decisions));

    problems.extend(audit_problem(&db));
    let mut statuses: BTreeMap<&str, usize> = BTreeMap::new();
    for run in &runs {
        *statuses.entry(run["status"].as_str().unwrap()).or_default() += 1;
    }
    let summary = format!(
        "seed {seed}; {WORKER_KILLS} worker kills in {kill_phase:.1?}, settled at {settled:.1?}; \
         {} runs {statuses:?}, {} executions, {} approvals ({} outcome_unknown); \
         slow worker starts: {slow_starts:?}",
        runs.len(),
        executions.len(),
        approvals.len(),
        approvals
            .iter()
            .filter(|a| a["kind"] == "outcome_unknown")
            .count(),
    );
    eprintln!("worker crash test: {summary}");
    let notable = notable_log_lines(&logs);
    for line in notable.iter().filter(|l| l.contains("\"level\":\"ERROR\"")) {
        problems.push(format!("a process logged an error: {line}"));
    }
    assert_eq!(runs.len(), WORKER_RUNS, "{summary}");
    // Not vacuous: kills landed while calls were in flight.
    assert!(
        approvals.iter().any(|a| a["kind"] == "outcome_unknown"),
        "no kill interrupted a call: {summary}"
    );
    assert!(
        executions.iter().any(|e| e.tool == "send"),
        "the consequential tool should have run: {summary}"
    );
    assert!(
        problems.is_empty(),
        "{} problem(s) ({summary}):\n  {}\n\nfirst warning lines:\n  {}",
        problems.len(),
        problems.join("\n  "),
        notable
            .get(..notable.len().min(20))
            .unwrap_or_default()
            .join("\n  ")
    );
}
