//! The deployment files in deploy/: the systemd unit passes
//! `systemd-analyze verify` with the binary this checkout builds.

use std::process::Command;

use kvrail_e2e::{binary, skip_or_fail, workspace_root};

#[test]
fn the_systemd_unit_passes_systemd_analyze_verify() {
    if Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_err()
    {
        skip_or_fail(
            "the_systemd_unit_passes_systemd_analyze_verify",
            "no systemd-analyze (apt-get install systemd)",
        );
        return;
    }
    let unit = std::fs::read_to_string(workspace_root().join("deploy/systemd/kvrail.service"))
        .expect("read deploy/systemd/kvrail.service");
    assert!(
        unit.contains("ExecStart=/usr/local/bin/kvrail serve"),
        "{unit}"
    );
    // Verified as installed: the unit's binary path is where the built one is.
    let kvrail = binary("kvrail");
    let installed = unit.replace("/usr/local/bin/kvrail", &kvrail.display().to_string());
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("kvrail.service");
    std::fs::write(&path, installed).expect("write unit");
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()
        .expect("run systemd-analyze");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // It exits 0 on options it ignores with a warning: those fail here too.
    assert!(
        out.status.success() && said.trim().is_empty(),
        "systemd-analyze verify:\n{said}"
    );
    // The hardening this unit promises is there.
    for option in [
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "CapabilityBoundingSet=",
        "RestrictAddressFamilies=",
        "SystemCallFilter=@system-service",
        "User=kvrail",
        "LimitMEMLOCK=infinity",
    ] {
        assert!(unit.contains(option), "the unit lacks {option}");
    }
}
