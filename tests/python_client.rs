//! The Python client and connector (clients/python) against the daemon built
//! here: installs the package with pip into a virtualenv under target/ and runs
//! its pytest suite, which starts real sidecars on loopback. Without Python 3
//! (and its venv module) the test says why and passes, except under CI, which
//! installs them (.ci/run) and where a skip would hide a failure.

use std::path::{Path, PathBuf};
use std::process::Command;

use kvrail_e2e::python::{self, run};

/// A virtualenv with the package installed (editable, so source edits count).
fn venv(root: &Path, target: &Path) -> Result<PathBuf, String> {
    let py = python::venv(target, "python-venv")?;
    run(Command::new(&py)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "-e",
        ])
        .arg(format!("{}[test]", root.join("clients/python").display())))?;
    Ok(py)
}

#[test]
fn python_client_and_connector() {
    let (kvrail, target) = python::daemon_and_target();
    let root = kvrail_e2e::workspace_root();
    let py = match venv(&root, &target) {
        Ok(py) => py,
        Err(e) => return kvrail_e2e::skip_or_fail("the Python client tests", &e),
    };
    let status = Command::new(&py)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .arg(root.join("clients/python/tests"))
        .env("KVRAIL_BIN", &kvrail)
        .status()
        .expect("run pytest");
    assert!(status.success(), "the Python client tests failed");
}
