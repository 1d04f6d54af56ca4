//! `sglang-tree-bench`: SGLang's Rust `TokenTree` replaying a dumped workload the way
//! `kvstrata bench radix` replays it through kvstrata's tree.
//!
//! Per request: `match_prefix_with_counts`, then `insert_tokens` of the whole request, then, when
//! the tree holds more than the budget, `evict_tenant_by_size` (the tree's own size-based LRU
//! eviction) down to 90 % of it. One tenant. Only those calls are timed. The replay runs twice on
//! fresh trees: with no eviction (its matched lengths must equal the workload's tree-free
//! reference) and with the budget. Prints one JSON line.
//!
//! Usage: sglang-tree-bench --dump FILE [--page-size P] [--budget TOKENS]
//!   FILE: per request a uint32 little-endian length, then that many uint32 tokens
//!   (`python -m kvstrata.workloads.shared_synthetic --dump FILE`).

use std::{
    fs,
    hint::black_box,
    process::ExitCode,
    time::{Duration, Instant},
};

use kv_index::{EvictionPolicy, TokenTree};
use sha2::{Digest, Sha256};

const TENANT: &str = "worker-0";

struct Args {
    dump: String,
    page_size: usize,
    budget_tokens: usize,
}

fn usage(msg: &str) -> ExitCode {
    eprintln!("sglang-tree-bench: {msg}");
    eprintln!("usage: sglang-tree-bench --dump FILE [--page-size P (default 1)] [--budget TOKENS (default 262144)]");
    ExitCode::from(2)
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        dump: String::new(),
        page_size: 1,
        budget_tokens: 262_144,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--dump" => args.dump = value()?,
            "--page-size" => {
                args.page_size = value()?.parse().map_err(|e| format!("--page-size: {e}"))?
            }
            "--budget" => {
                args.budget_tokens = value()?.parse().map_err(|e| format!("--budget: {e}"))?
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if args.dump.is_empty() {
        return Err("--dump FILE is required".into());
    }
    if args.page_size == 0 || args.budget_tokens < args.page_size {
        return Err(format!(
            "--page-size must be >= 1 and --budget >= the page size (got {} and {})",
            args.page_size, args.budget_tokens
        ));
    }
    Ok(args)
}

/// The dump's requests: per request a u32 LE length, then that many u32 LE tokens.
fn load(path: &str) -> Result<Vec<Vec<u32>>, String> {
    let bytes = fs::read(path).map_err(|e| format!("cannot read {path}: {e}"))?;
    let word = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().unwrap());
    let mut requests = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        if at + 4 > bytes.len() {
            return Err(format!("{path}: truncated length at byte {at}"));
        }
        let n = word(at) as usize;
        at += 4;
        if at + 4 * n > bytes.len() {
            return Err(format!("{path}: request {} truncated", requests.len()));
        }
        requests.push((0..n).map(|k| word(at + 4 * k)).collect());
        at += 4 * n;
    }
    if requests.is_empty() {
        return Err(format!("{path} holds no requests"));
    }
    Ok(requests)
}

/// sha256 of the lengths as int64 LE, first 16 hex digits (shared_synthetic.matched_checksum).
fn matched_checksum(lengths: &[usize]) -> String {
    let mut h = Sha256::new();
    for &n in lengths {
        h.update((n as i64).to_le_bytes());
    }
    h.finalize()[..8].iter().map(|b| format!("{b:02x}")).collect()
}

struct Run {
    seconds: f64,
    match_s: f64,
    insert_s: f64,
    evictions: usize,
    matched: Vec<usize>,
    final_tokens: usize,
}

/// One replay on a fresh tree; `budget_tokens: None` never evicts.
fn replay(requests: &[Vec<u32>], page_size: usize, budget_tokens: Option<usize>) -> Run {
    let tree = TokenTree::with_config(page_size, EvictionPolicy::Lru);
    // Whole pages, as kvstrata's benchmark counts its budget (budget // P pages, low 90 % of them).
    let budget = budget_tokens.map(|b| {
        let pages = b / page_size;
        (pages * page_size, (pages as f64 * 0.9) as usize * page_size)
    });
    let mut matched = Vec::with_capacity(requests.len());
    let (mut t_match, mut t_insert) = (Duration::ZERO, Duration::ZERO);
    let mut evictions = 0;
    let start = Instant::now();
    for tokens in requests {
        let t0 = Instant::now();
        let hit = tree.match_prefix_with_counts(black_box(tokens));
        let t1 = Instant::now();
        tree.insert_tokens(tokens, TENANT);
        if let Some((high, low)) = budget {
            if tree.total_token_size() > high {
                tree.evict_tenant_by_size(low);
                evictions += 1;
            }
        }
        let t2 = Instant::now();
        t_match += t1 - t0;
        t_insert += t2 - t1;
        matched.push(hit.matched_token_count);
    }
    let seconds = start.elapsed().as_secs_f64();
    Run {
        seconds,
        match_s: t_match.as_secs_f64(),
        insert_s: t_insert.as_secs_f64(),
        evictions,
        matched,
        final_tokens: tree.total_token_size(),
    }
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(msg) => return usage(&msg),
    };
    let requests = match load(&args.dump) {
        Ok(r) => r,
        Err(msg) => {
            eprintln!("sglang-tree-bench: {msg}");
            return ExitCode::from(1);
        }
    };
    let n = requests.len() as f64;
    let noevict = replay(&requests, args.page_size, None);
    let evict = replay(&requests, args.page_size, Some(args.budget_tokens));
    println!(
        concat!(
            "{{\"peer\": \"sglang-tree-bench\", \"tree\": \"kv_index::TokenTree (smg 1.13.0)\", ",
            "\"page_size\": {}, \"budget_tokens\": {}, \"requests\": {}, ",
            "\"requests_per_s\": {:.1}, \"match_us\": {:.2}, \"insert_us\": {:.2}, ",
            "\"evictions\": {}, \"final_tokens\": {}, \"matched_tokens\": {}, ",
            "\"matched_checksum\": \"{}\", \"noevict_requests_per_s\": {:.1}, ",
            "\"noevict_matched_checksum\": \"{}\"}}"
        ),
        args.page_size,
        args.budget_tokens,
        requests.len(),
        n / evict.seconds,
        evict.match_s / n * 1e6,
        evict.insert_s / n * 1e6,
        evict.evictions,
        evict.final_tokens,
        evict.matched.iter().sum::<usize>(),
        matched_checksum(&evict.matched),
        n / noevict.seconds,
        matched_checksum(&noevict.matched),
    );
    ExitCode::SUCCESS
}
