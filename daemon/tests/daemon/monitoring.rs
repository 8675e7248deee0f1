//! The monitoring component (`deploy/kubernetes/components/monitoring`): its alert rules pass
//! `promtool check rules`, each alert has a `promtool test rules` case and a runbook entry in
//! docs/operations.md, and every series the rules and the Grafana dashboard name is one a real
//! daemon serves on /metrics (over mutual TLS) or the failover controller serves on its own
//! (`ferrite_failover_*`), whose texts pass `promtool check metrics`.

use crate::common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::csi::{certs, free_port};
use common::{Daemon, have, scrape_tls};

fn component() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes/components/monitoring")
}

/// The rule groups of the PrometheusRule: its `spec:` block, which is last, as a rules file.
fn rule_file(dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(component().join("prometheusrule.yaml")).unwrap();
    let (_, spec) = text.split_once("\nspec:\n").expect("the PrometheusRule ends with its spec");
    let rules: String = spec.lines().map(|l| format!("{}\n", l.strip_prefix("  ").unwrap_or(l))).collect();
    let path = dir.join("rules.yaml");
    std::fs::write(&path, rules).unwrap();
    path
}

fn promtool(args: &[&str], stdin: Option<&str>) -> (bool, String) {
    use std::io::Write;
    let mut c = Command::new("promtool");
    c.args(args).stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped());
    c.stderr(std::process::Stdio::piped());
    let mut child = c.spawn().unwrap();
    child.stdin.take().unwrap().write_all(stdin.unwrap_or("").as_bytes()).unwrap();
    let o = child.wait_with_output().unwrap();
    (o.status.success(), format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
}

/// The `ferrite_*` names in `text` (PromQL expressions, a dashboard).
fn series(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("ferrite_") {
        let tail = &rest[at..];
        let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
        out.insert(tail[..end].to_owned());
        rest = &tail[end..];
    }
    out
}

#[test]
fn the_alert_rules_check_and_each_has_a_test_and_a_runbook() {
    if !have("promtool") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let rules = rule_file(dir.path());
    let (ok, out) = promtool(&["check", "rules", rules.to_str().unwrap()], None);
    assert!(ok, "promtool check rules: {out}");
    let tests = dir.path().join("rules.test.yaml");
    std::fs::copy(component().join("tests/rules.test.yaml"), &tests).unwrap();
    let (ok, out) = promtool(&["test", "rules", tests.to_str().unwrap()], None);
    assert!(ok, "promtool test rules: {out}");

    let text = std::fs::read_to_string(&rules).unwrap();
    let alerts: Vec<&str> = text.lines().filter_map(|l| l.trim().strip_prefix("- alert: ")).collect();
    assert!(alerts.len() >= 12, "{alerts:?}");
    let cases = std::fs::read_to_string(&tests).unwrap();
    let runbook = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/operations.md")).unwrap();
    for a in &alerts {
        assert!(cases.contains(&format!("alertname: {a}")), "{a} has no promtool test case");
        assert!(runbook.contains(&format!("\n#### {a}\n")), "{a} has no runbook entry in docs/operations.md");
        let anchor = format!("docs/operations.md#{}\"", a.to_lowercase());
        assert!(text.contains(&anchor), "{a}'s runbook_url is not its entry ({anchor})");
    }
}

#[test]
fn a_daemon_serves_every_series_the_rules_and_the_dashboard_name() {
    if !have("promtool") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki");
    certs(&pki, "server", &["127.0.0.1"]);
    certs(&pki, "prometheus", &[]);
    let metrics = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let p = |f: &str| pki.join(f).display().to_string();
    std::fs::write(
        data.join("ferrite.toml"),
        format!(
            "pool-size = \"1G\"\nsegment-size = \"4M\"\nmetrics-listen = \"{metrics}\"\n\
             tls-cert = {:?}\ntls-key = {:?}\ntls-client-ca = {:?}\n[roles]\n\"prometheus\" = \"metrics\"\n",
            p("server.pem"),
            p("server-key.pem"),
            p("ca.pem")
        ),
    )
    .unwrap();
    let d = Daemon::start(&data);
    let identity = (pki.join("prometheus.pem"), pki.join("prometheus-key.pem"));
    let reply = scrape_tls(&metrics, &pki.join("ca.pem"), Some((&identity.0, &identity.1))).unwrap();
    let (head, body) = reply.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    // promtool 2.42 looks for a counter's HELP under its sample name (`x_total`); the
    // OpenMetrics text prometheus-client writes gives it under the family (`x`). That finding
    // alone is accepted, for counters whose family has its HELP.
    let controller = ferrite_csi::kube::failover::Metrics::default().render();
    for text in [body, &controller] {
        let (_, out) = promtool(&["check", "metrics"], Some(text));
        let findings: Vec<&str> = out
            .lines()
            .filter(|l| {
                let family = l.strip_suffix("_total no help text");
                !family.is_some_and(|f| text.contains(&format!("# HELP {f} ")))
            })
            .filter(|l| !l.trim().is_empty())
            .collect();
        assert!(findings.is_empty(), "promtool check metrics:\n{}", findings.join("\n"));
    }

    let families: BTreeSet<&str> = body
        .lines()
        .chain(controller.lines())
        .filter_map(|l| l.strip_prefix("# TYPE ")?.split_whitespace().next())
        .collect();
    let rules = std::fs::read_to_string(rule_file(dir.path())).unwrap();
    let dashboard = std::fs::read_to_string(component().join("dashboard.json")).unwrap();
    let named = series(&rules).into_iter().chain(series(&dashboard));
    for s in named {
        let family = ["_total", "_bucket", "_count", "_sum"].iter().find_map(|x| s.strip_suffix(x)).unwrap_or(&s);
        assert!(
            families.contains(family),
            "{s} is named by the rules or the dashboard but neither the daemon nor the controller serves it"
        );
    }
    // The certificate's expiry is the server certificate's.
    let cert = ferrite_tls::load_certs(&pki.join("server.pem")).unwrap();
    let expiry = ferrite_tls::validity(&cert[0]).unwrap().1;
    let line = format!("ferrite_tls_certificate_expiry_timestamp_seconds {expiry}");
    assert!(body.lines().any(|l| l == line), "{line} not in:\n{body}");
    for healthy in ["ferrite_fences 0", "ferrite_pool_failed 0", "ferrite_pool_checksum_errors_total 0"] {
        assert!(body.lines().any(|l| l == healthy), "{healthy} not in:\n{body}");
    }
    drop(d);
}
