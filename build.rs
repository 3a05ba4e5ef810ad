//! Records the commit the binary is built from, for `bloomgate_build_info`:
//! `BLOOMGATE_COMMIT` from the environment if set (a Docker build without
//! `.git`), else `git rev-parse --short=12 HEAD`, else `unknown`.

use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=BLOOMGATE_COMMIT");
    let git = |args: &[&str]| -> Option<String> {
        let out = Command::new("git").args(args).output().ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    // A worktree keeps HEAD in its own git directory and the branches in
    // the common one. Only paths that exist: cargo reruns a build script
    // whose watched path is missing on every build (no `packed-refs` until
    // git packs), and each rerun recompiled the crate.
    let watch = |path: String| {
        if std::path::Path::new(&path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    };
    if let Some(dir) = git(&["rev-parse", "--git-dir"]) {
        watch(format!("{dir}/HEAD"));
    }
    if let Some(dir) = git(&["rev-parse", "--git-common-dir"]) {
        watch(format!("{dir}/refs/heads"));
        watch(format!("{dir}/packed-refs"));
    }
    let commit = std::env::var("BLOOMGATE_COMMIT")
        .ok()
        .filter(|c| !c.is_empty())
        .or_else(|| git(&["rev-parse", "--short=12", "HEAD"]))
        .filter(|c| c.bytes().all(|b| b.is_ascii_alphanumeric()))
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=BLOOMGATE_COMMIT={commit}");
}
