//! `cascade instance` on SIGTERM, as an orchestrator scaling in sends it: the process
//! stops its instance first — the batches it took are computed and answered, those not taken
//! yet are refused as "stopped" (a router sends them elsewhere) — and only then leaves the
//! cluster, exiting 0. Runs the real MiniLM; skips, saying so, without it.
#![allow(clippy::unwrap_used)]

use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cascade_exec::serve::{ExecMsg, ServeError};
use cascade_transport::{ClusterSpec, Endpoint, EndpointConfig, ServiceExt};

const CASCADE: &str = env!("CARGO_BIN_EXE_cascade");
const SECRET: &str = "graceful-secret";

#[test]
fn an_instance_told_to_terminate_answers_what_it_took_and_exits_cleanly() {
    let Some(model) = cascade_tests::models::minilm() else { return };
    let dir = std::env::temp_dir().join(format!("cascade-graceful-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // Node 0: this test, asking; node 1: the instance, serving a held copy.
    let addrs = cascade_tests::free_addrs(2);
    let mut toml = format!("name = \"graceful{}\"\n", std::process::id());
    for (i, a) in addrs.iter().enumerate() {
        toml += &format!("[[nodes]]\nid = {i}\naddr = \"{a}\"\n");
    }
    let cluster = dir.join("cluster.toml");
    std::fs::write(&cluster, &toml).unwrap();
    let mut child = Command::new(CASCADE)
        .args(["instance", "--node", "1", "--no-shm", "--max-batch", "8", "--cluster"])
        .arg(&cluster)
        .arg("--model")
        .arg(&model)
        .env("CASCADE_SECRET", SECRET)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let log = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let pid = child.id() as libc::pid_t;
    let answers = rt.block_on(async {
        let spec = ClusterSpec::from_toml(&toml).unwrap();
        let mut cfg = EndpointConfig::new(0, spec, SECRET.as_bytes());
        cfg.shm = false;
        let ep = Endpoint::start(cfg).await.unwrap();
        ep.wait_ready(Duration::from_secs(60)).await.unwrap();
        let ep = Arc::new(ep);
        // The instance serves once its copy is loaded: until then the node has no exec service.
        let t0 = Instant::now();
        while !matches!(ep.call(1, &ExecMsg::Status, Duration::from_secs(5)).await, Ok(ExecMsg::State { .. })) {
            assert!(t0.elapsed() < Duration::from_secs(60), "the instance never served");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let texts: Vec<String> = (0..8).map(|i| format!("Request {i} of a node that is told to leave.")).collect();
        let (first_tx, mut first_rx) = tokio::sync::mpsc::unbounded_channel();
        let calls: Vec<_> = (0..12u64)
            .map(|batch| {
                let (ep, first) = (ep.clone(), first_tx.clone());
                let msg = ExecMsg::Run { batch, texts: texts.clone(), split: None, onward: None };
                tokio::spawn(async move {
                    let a = ep.call(1, &msg, Duration::from_secs(60)).await;
                    let _ = first.send(());
                    a
                })
            })
            .collect();
        // One batch came back: the instance holds the others, queued for its compute thread.
        first_rx.recv().await;
        // SAFETY: kill(2) with a child's pid and a valid signal number; it touches no memory.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
        let mut answers = Vec::new();
        for c in calls {
            answers.push(c.await.unwrap());
        }
        ep.shutdown();
        answers
    });

    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("the instance did not exit within 30 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let log = log.join().unwrap();
    let mut done = 0;
    for a in &answers {
        match a {
            Ok(ExecMsg::Done { embeddings, .. }) => {
                assert_eq!(embeddings.len(), 8);
                done += 1;
            }
            Ok(ExecMsg::Failed { message, retry: true }) if *message == ServeError::Stopped.to_string() => {}
            other => panic!("a batch sent before SIGTERM: {other:?}\n{log}"),
        }
    }
    assert!(done >= 2, "only {done} of 12 batches answered: those the instance held were not finished\n{log}");
    assert!(status.success(), "exit {status:?}:\n{log}");
    assert!(log.contains("node 1: instance stopped in"), "{log}");
    eprintln!("SIGTERM: {done} of 12 batches answered, the rest refused as stopped; {}", log.trim());
    let _ = std::fs::remove_dir_all(&dir);
}
