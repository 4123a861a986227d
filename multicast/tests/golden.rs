//! Data-driven golden tests of the planner (raft-rs style). Each `testdata/*.txt` holds cases
//! separated by `====`; a case is `topology` + TOML, `----`, a `plan` command, `----`, and the
//! expected plan text. `CASCADE_UPDATE_GOLDEN=1 cargo test -p cascade-multicast --test golden`
//! rewrites the expectations — review the diff before committing it.
#![allow(clippy::unwrap_used)]

use std::path::Path;

use cascade_multicast::{plan, Loc, PlannerKind, Request, Topology};

fn run_command(topo: &Topology, cmd: &str) -> String {
    let mut words = cmd.split_whitespace();
    assert_eq!(words.next(), Some("plan"), "unknown command {cmd:?}");
    let kind: PlannerKind = words.next().unwrap().parse().unwrap();
    let mut r = Request { bytes: 0, sources: vec![], targets: vec![] };
    for w in words {
        let (k, v) = w.split_once('=').unwrap();
        let locs = || v.split(',').map(|l| l.parse::<Loc>().unwrap()).collect::<Vec<_>>();
        match k {
            "bytes" => r.bytes = v.parse().unwrap(),
            "sources" => r.sources = locs(),
            "targets" => r.targets = locs(),
            _ => panic!("unknown argument {k}"),
        }
    }
    match plan(topo, &r, kind) {
        Ok(p) => p.to_string(),
        Err(e) => format!("error: {e}\n"),
    }
}

fn check_file(path: &Path) {
    let text = std::fs::read_to_string(path).unwrap();
    let update = std::env::var_os("CASCADE_UPDATE_GOLDEN").is_some();
    let mut out = String::new();
    let mut failures = Vec::new();
    for (i, case) in text.split("\n====\n").enumerate() {
        let parts: Vec<&str> = case.split("\n----\n").collect();
        assert_eq!(parts.len(), 3, "{}: case {i} needs topology, command and expectation", path.display());
        let topo_text = parts[0].lines().skip_while(|l| l.starts_with('#') || l.trim().is_empty()).collect::<Vec<_>>();
        assert_eq!(topo_text.first().copied(), Some("topology"), "{}: case {i}", path.display());
        let topo = Topology::from_toml(&topo_text[1..].join("\n")).unwrap();
        let got = run_command(&topo, parts[1].trim());
        let want = parts[2].trim_end_matches('\n').to_string() + "\n";
        if got != want {
            failures.push(format!("case {i} ({}):\n--- want\n{want}--- got\n{got}", parts[1].trim()));
        }
        out += &format!("{}\n----\n{}\n----\n{}", parts[0], parts[1].trim(), got);
        out += "====\n";
    }
    if update {
        std::fs::write(path, out.trim_end_matches("====\n").trim_end_matches('\n').to_string() + "\n").unwrap();
    } else if !failures.is_empty() {
        panic!("{}:\n{}", path.display(), failures.join("\n"));
    }
}

#[test]
fn golden_plans() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "txt") {
            check_file(&p);
            n += 1;
        }
    }
    assert!(n > 0, "no golden files in {}", dir.display());
}
