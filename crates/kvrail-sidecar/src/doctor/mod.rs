//! `kvrail doctor`: checks what DGX Spark and ConnectX users otherwise check by
//! hand, rail by rail (address, link, bond, MTU, subnet conflicts, RDMA device,
//! GID and port, multi-host halves, the GPU path), then probes each peer on each
//! rail with a real handshake. Prints a table (or `--json`) with a fix for each
//! problem; exits 1 when anything failed.

pub mod checks;
pub mod facts;
pub mod probe;

use std::io::Write;
use std::time::Duration;

use checks::{Finding, Status};

use crate::config::Config;
use crate::ServeArgs;

/// Flags of `kvrail doctor`: the node's configuration as `kvrail serve` takes it.
#[derive(Debug, Clone, clap::Args)]
pub struct DoctorArgs {
    #[command(flatten)]
    pub serve: ServeArgs,
    /// Print one JSON document instead of the table.
    #[arg(long)]
    pub json: bool,
    /// How long each peer probe may take.
    #[arg(long, default_value_t = 3000)]
    pub probe_timeout_ms: u64,
    /// Check this host only; do not contact peers.
    #[arg(long)]
    pub no_peers: bool,
}

/// Everything doctor found, host findings first, then rail by rail.
pub async fn examine(config: &Config, probe_peers: bool, timeout: Duration) -> Vec<Finding> {
    let facts = tokio::task::block_in_place(facts::gather);
    let mut out = checks::host(config, &facts);
    for (i, addr) in config.listen.iter().enumerate() {
        out.extend(checks::rail(config, &facts, i, addr.ip()));
    }
    if probe_peers {
        out.extend(probe::peers(config, timeout).await);
    }
    out
}

/// Runs doctor; the process exit code (0 healthy or warnings only, 1 failures).
pub async fn run(args: DoctorArgs) -> anyhow::Result<i32> {
    let config = args.serve.to_config()?;
    let findings = examine(
        &config,
        !args.no_peers,
        Duration::from_millis(args.probe_timeout_ms),
    )
    .await;
    let failed = findings.iter().any(|f| f.status == Status::Fail);
    let mut out = std::io::stdout().lock();
    if args.json {
        let doc = serde_json::json!({
            "node": config.node,
            "kvrail": env!("CARGO_PKG_VERSION"),
            "healthy": !failed,
            "findings": findings,
        });
        writeln!(out, "{}", serde_json::to_string_pretty(&doc)?)?;
    } else {
        write!(out, "{}", table(&config, &findings))?;
    }
    Ok(i32::from(failed))
}

/// The human report: one line per finding, its fix indented below it.
pub fn table(config: &Config, findings: &[Finding]) -> String {
    let mut s = format!(
        "kvrail doctor {} for node {:?} ({} rails, {} peers)\n\n",
        env!("CARGO_PKG_VERSION"),
        config.node,
        config.listen.len(),
        config.peers.len()
    );
    s.push_str(&format!(
        "{:<6} {:<5} {:<10} {}\n",
        "STATUS", "RAIL", "CHECK", "DETAIL"
    ));
    for f in findings {
        let rail = f.rail.map(|r| r.to_string()).unwrap_or_else(|| "-".into());
        s.push_str(&format!(
            "{:<6} {:<5} {:<10} {}\n",
            f.status.label(),
            rail,
            f.check,
            printable(&f.detail)
        ));
        if let Some(fix) = &f.fix {
            if f.status >= Status::Warn || f.status == Status::Info {
                s.push_str(&format!("{:<23} fix: {}\n", "", printable(fix)));
            }
        }
    }
    let count = |st| findings.iter().filter(|f| f.status == st).count();
    s.push_str(&format!(
        "\n{} failed, {} warnings, {} ok\n",
        count(Status::Fail),
        count(Status::Warn),
        count(Status::Ok)
    ));
    s
}

/// Text for a terminal: control characters (escape sequences, line breaks
/// that would forge a row of the table) and bidirectional overrides written
/// as `\u{..}`. Details quote what peers said (their software string, their
/// refusal), which a peer controls.
fn printable(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        let bidi = matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
        if c.is_control() || bidi {
            out.push_str(&c.escape_unicode().to_string());
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer's software string (or refusal) with escape sequences and a
    /// forged row reaches the table escaped, on one row.
    #[test]
    fn peer_text_cannot_forge_rows_or_move_the_cursor() {
        let config = Config {
            node: "a".into(),
            ..Config::default()
        };
        let forged = "kvrail 9\u{1b}[2K\rOK     -     link       all good\n\u{9b}31m\u{202e}x";
        let findings = [Finding {
            status: Status::Fail,
            check: "peer",
            rail: Some(0),
            detail: format!("peer answers as {forged}"),
            fix: Some(forged.into()),
        }];
        let out = table(&config, &findings);
        assert!(!out.chars().any(|c| c.is_control() && c != '\n'), "{out:?}");
        assert!(!out.contains('\u{202e}'), "{out:?}");
        let rows: Vec<&str> = out.lines().filter(|l| l.contains("all good")).collect();
        assert_eq!(rows.len(), 2, "{out}");
        assert!(
            rows.iter()
                .all(|r| r.contains("\\u{1b}") && r.contains("\\u{a}")),
            "{out}"
        );
        assert!(!out.lines().any(|l| l.starts_with("OK ")), "{out}");
    }
}
