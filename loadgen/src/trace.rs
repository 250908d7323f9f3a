//! Mooncake-format request traces (JSONL: timestamp ms, input_length, output_length, hash_ids).

use std::path::Path;

use serde::Deserialize;

/// One request of a trace.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct Request {
    pub timestamp: u64,
    pub input_length: u64,
    pub output_length: u64,
    #[serde(default)]
    pub hash_ids: Vec<u64>,
}

/// Reads up to `limit` requests; a bad line is an error naming the file and line.
pub fn read_mooncake(path: &Path, limit: usize) -> anyhow::Result<Vec<Request>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if out.len() >= limit {
            break;
        }
        if line.trim().is_empty() {
            continue;
        }
        let r: Request = serde_json::from_str(line)
            .map_err(|e| anyhow::anyhow!("{}:{}: {e}", path.display(), i + 1))?;
        out.push(r);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lines_and_names_the_bad_one() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.jsonl");
        std::fs::write(&p, "{\"timestamp\":0,\"input_length\":10,\"output_length\":2,\"hash_ids\":[1]}\n\n{\"timestamp\":5,\"input_length\":\"x\"}\n").unwrap();
        let err = read_mooncake(&p, 10).unwrap_err().to_string();
        assert!(err.contains("t.jsonl:3"), "{err}");
        let ok = read_mooncake(&p, 1).unwrap();
        assert_eq!(ok[0].input_length, 10);
    }

    #[test]
    fn bundled_trace_slice_parses() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("traces/conversation_trace_head.jsonl");
        let r = read_mooncake(&p, usize::MAX).unwrap();
        assert_eq!(r.len(), 500);
        assert_eq!(r[0].input_length, 6758);
    }
}
