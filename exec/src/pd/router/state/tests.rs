//! The routing state's tests: requests, attempts and instances driven by hand, no transport.

use cascade_transport::service::{ServiceFault, ServiceId};
use cascade_transport::TransportError;

use super::*;
use crate::serve::{DispatchConfig, LivePolicy};

/// A router with prefill instances 1 (old) and `more`, decode instances 2 and 3.
fn routing(more: Vec<u32>) -> (Routing, mpsc::UnboundedReceiver<GenAnswer>) {
    let cfg = PdRouterConfig {
        dispatch: DispatchConfig {
            policy: LivePolicy::Zigzag,
            layers: 4,
            old: 1,
            per_instance: 2,
            max_coop: 4,
            load_ratio: 2,
        },
        more_prefill: more,
        decode: vec![2, 3],
        call_timeout: Duration::from_secs(10),
        poll_every: Duration::from_millis(10),
        max_attempts: 4,
        retry_after: Duration::ZERO,
        monitor: None,
        replace_lost_decode: false,
        stall_after: Duration::from_secs(30),
        tokenizer: None,
    };
    let (tx, rx) = mpsc::unbounded_channel();
    (Routing::new(cfg, tx), rx)
}

fn request(r: &mut Routing, id: u64) {
    r.arrive(GenRequest {
        id,
        prompt: vec![1, 2, 3],
        max_tokens: 3,
        adapter: 0,
        sample: None,
        stop: Default::default(),
        tokens: None,
    });
}

/// The calls `r` names now that `pick` picks.
fn taken<T>(r: &mut Routing, pick: impl FnMut(Action) -> Option<T>) -> Vec<T> {
    r.actions().into_iter().filter_map(pick).collect()
}

/// The prefills dispatched now: (request, attempt, prefill node).
fn prefills(r: &mut Routing) -> Vec<(u64, u32, u32)> {
    r.dispatch();
    taken(r, |a| match a {
        Action::Prefill { req, attempt, to, .. } => Some((req.id, attempt, to)),
        _ => None,
    })
}

fn token(req: u64, attempt: u32, index: u32, token: u32, done: bool) -> LlmMsg {
    LlmMsg::Token { req, attempt, lease: 40 + u64::from(attempt), index, token, done }
}

fn decoding(node: u32, attempt: u32) -> Outcome {
    Outcome::Done { first: 7, decoding: true, on_first: 0, node, lease: 40 + u64::from(attempt) }
}

/// A request whose id is pending already is refused under that id, and the pending one is
/// still served and answered; so is one asking for no token, with no prompt, or with sampling
/// settings out of range.
#[test]
fn a_duplicate_id_or_an_empty_request_is_refused_and_the_pending_one_kept() {
    let (mut r, mut answers) = routing(vec![]);
    request(&mut r, 5);
    request(&mut r, 5);
    r.arrive(GenRequest {
        id: 6,
        prompt: vec![1],
        max_tokens: 0,
        adapter: 0,
        sample: None,
        stop: Default::default(),
        tokens: None,
    });
    r.arrive(GenRequest {
        id: 7,
        prompt: vec![],
        max_tokens: 4,
        adapter: 0,
        sample: None,
        stop: Default::default(),
        tokens: None,
    });
    let sampling = crate::llama::sample::Sampling { temperature: 1.0, top_k: 0, top_p: 1.5, seed: 1 };
    let sample = Some(crate::pd::proto::SeqSampling { sampling, index: 0 });
    r.arrive(GenRequest {
        id: 8,
        prompt: vec![1],
        max_tokens: 4,
        adapter: 0,
        sample,
        stop: Default::default(),
        tokens: None,
    });
    let refused: Vec<(u64, String)> =
        std::iter::from_fn(|| answers.try_recv().ok()).map(|a| (a.id, a.result.unwrap_err())).collect();
    assert_eq!(refused.len(), 4, "{refused:?}");
    assert!(refused[0] == (5, "request id 5 is already pending".into()), "{refused:?}");
    assert!(refused[1].1.contains("0 to generate") && refused[2].1.contains("0 prompt tokens"), "{refused:?}");
    assert!(refused[3].0 == 8 && refused[3].1.contains("top-p 1.5"), "{refused:?}");
    assert_eq!(r.stats.failed, 4);
    // The first request 5 goes on: one prefill, and its tokens answer it.
    assert_eq!(prefills(&mut r), vec![(5, 1, 1)]);
    r.prefilled(5, 1, decoding(2, 1));
    r.message(2, token(5, 1, 1, 8, false));
    r.message(2, token(5, 1, 2, 9, true));
    r.after(Instant::now());
    let a = answers.try_recv().expect("request 5 answered");
    assert_eq!((a.id, a.result), (5, Ok(vec![7, 8, 9])));
}

/// A decode instance that leaves gets no new request, its requests are moved to the other
/// decode instance, and a moved request counts as decoding there even before its first token
/// from there: losing the leaving node then redoes nothing.
#[test]
fn a_leaving_decode_instance_is_drained_into_the_others() {
    let (mut r, mut answers) = routing(vec![]);
    request(&mut r, 5);
    assert_eq!(prefills(&mut r), vec![(5, 1, 1)]);
    r.prefilled(5, 1, decoding(3, 1));
    r.message(3, token(5, 1, 1, 8, false));
    r.message(3, LlmMsg::Leaving { running: 1 });
    let drains = taken(&mut r, |a| match a {
        Action::Drain { from, to, .. } => Some((from, to)),
        _ => None,
    });
    assert_eq!(drains, vec![(3, vec![2])]);
    assert_eq!((r.decode.clone(), r.decode_target, r.stats.decode_left), (vec![2], 1, 1));
    // A new request reserves its KV on node 2 only.
    request(&mut r, 6);
    r.dispatch();
    let orders = taken(&mut r, |a| match a {
        Action::Prefill { order, .. } => Some(order),
        _ => None,
    });
    assert_eq!(orders, vec![vec![2]]);
    r.moved(5, 3, 2);
    assert_eq!(r.stats.drain_moved, 1);
    r.peer_event(PeerEvent::Down { peer: 3, reason: "it stopped".into(), graceful: false });
    r.message(2, token(5, 1, 2, 9, true));
    r.after(Instant::now());
    let a = answers.try_recv().unwrap();
    assert_eq!((a.result, a.decode, a.attempts), (Ok(vec![7, 8, 9]), 2, 1));
    assert_eq!(r.stats.requeued, 0);
}

#[test]
fn only_the_awaited_attempts_tokens_make_the_answer_and_a_stale_decode_is_stopped() {
    let (mut r, mut answers) = routing(vec![]);
    request(&mut r, 5);
    assert_eq!(prefills(&mut r), vec![(5, 1, 1)]);
    r.prefilled(5, 1, decoding(2, 1));
    // Attempt 1 decodes on node 2; a decode of attempt 0 (given up on) streams from node 3.
    r.message(3, token(5, 0, 1, 666, false));
    r.message(2, token(5, 1, 1, 8, false));
    r.message(3, token(5, 0, 2, 667, false));
    r.message(2, token(5, 1, 2, 9, true));
    r.after(Instant::now());
    let a = answers.try_recv().unwrap();
    assert_eq!((a.result, a.decode, a.attempts), (Ok(vec![7, 8, 9]), 2, 1));
    assert_eq!(r.stats.stale_tokens, 2);
    let stops = taken(&mut r, |a| match a {
        Action::Stop { node, req, lease } => Some((node, req, lease)),
        _ => None,
    });
    assert_eq!(stops, vec![(3, 5, 40), (3, 5, 40)], "each stale token asks its decode to stop");
    // Late tokens of the answered request are stale too.
    r.message(2, token(5, 1, 3, 10, false));
    assert_eq!(r.stats.stale_tokens, 3);
}

#[test]
fn a_decode_that_goes_silent_is_stopped_and_its_request_redone() {
    let (mut r, mut answers) = routing(vec![]);
    request(&mut r, 1);
    prefills(&mut r);
    r.prefilled(1, 1, decoding(2, 1));
    r.message(2, token(1, 1, 1, 8, false));
    let stall = r.cfg.stall_after;
    // Tokens keep it alive; a wait just short of the limit changes nothing.
    r.after(Instant::now() + stall - Duration::from_millis(100));
    assert_eq!((r.stats.stalled, r.stats.requeued), (0, 0));
    r.after(Instant::now() + stall);
    assert_eq!((r.stats.stalled, r.stats.requeued), (1, 1));
    let stops = taken(&mut r, |a| match a {
        Action::Stop { node, req, lease } => Some((node, req, lease)),
        _ => None,
    });
    assert_eq!(stops, vec![(2, 1, 41)], "the silent decode is told to stop");
    // Redone on node 3; a late token of the silent attempt does not count.
    assert_eq!(prefills(&mut r), vec![(1, 2, 1)]);
    r.prefilled(1, 2, decoding(3, 2));
    r.message(2, token(1, 1, 2, 666, true));
    r.message(3, token(1, 2, 1, 8, false));
    r.message(3, token(1, 2, 2, 9, true));
    r.after(Instant::now());
    let a = answers.try_recv().unwrap();
    assert_eq!((a.result, a.attempts), (Ok(vec![7, 8, 9]), 2));
    // A complete answer waiting for nothing is never given up on.
    assert_eq!(r.stats.stalled, 1);
}

#[test]
fn an_abort_of_another_attempt_changes_nothing_and_one_of_this_attempt_redoes_it() {
    let (mut r, mut answers) = routing(vec![]);
    request(&mut r, 1);
    prefills(&mut r);
    r.prefilled(1, 1, decoding(2, 1));
    r.message(3, LlmMsg::Abort { req: 1, attempt: 0, message: "stale".into() });
    assert_eq!((r.stats.requeued, prefills(&mut r)), (0, vec![]));
    r.message(2, token(1, 1, 1, 8, false));
    r.message(2, LlmMsg::Abort { req: 1, attempt: 1, message: "step failed".into() });
    assert_eq!((r.stats.requeued, prefills(&mut r)), (1, vec![(1, 2, 1)]));
    // The first attempt's tokens do not count for the second.
    r.prefilled(1, 2, decoding(3, 2));
    r.message(2, token(1, 1, 2, 9, true));
    r.message(3, token(1, 2, 1, 18, false));
    r.message(3, token(1, 2, 2, 19, true));
    r.after(Instant::now());
    let a = answers.try_recv().unwrap();
    assert_eq!((a.result, a.decode, a.attempts), (Ok(vec![7, 18, 19]), 3, 2));
}

#[test]
fn an_abort_before_the_prefill_answered_redoes_the_request_once_the_answer_comes() {
    let (mut r, _answers) = routing(vec![]);
    request(&mut r, 1);
    prefills(&mut r);
    r.message(2, LlmMsg::Abort { req: 1, attempt: 1, message: "step failed".into() });
    // Not beside the attempt still in flight.
    assert_eq!(prefills(&mut r), vec![]);
    r.prefilled(1, 1, decoding(2, 1));
    let stop = r.actions().into_iter().any(|a| matches!(a, Action::Stop { node: 2, req: 1, lease: 41 }));
    assert!(stop, "the aborted attempt's decode, if it still runs, is stopped");
    r.after(Instant::now());
    assert_eq!((r.stats.requeued, prefills(&mut r)), (1, vec![(1, 2, 1)]));
}

#[test]
fn a_node_that_runs_no_service_is_gone_and_probed_and_comes_back_whole() {
    let (mut r, _answers) = routing(vec![4]);
    request(&mut r, 1);
    request(&mut r, 2);
    request(&mut r, 3);
    let sent = prefills(&mut r);
    let (id, attempt, _) = *sent.iter().find(|p| p.2 == 4).expect("node 4 takes a prefill");
    let fault = TransportError::Service { peer: 4, service: ServiceId::LLM, fault: ServiceFault::UnknownService };
    r.prefilled(id, attempt, Outcome::Failed(fault.into()));
    let probes = taken(&mut r, |a| match a {
        Action::Probe { node, whole } => Some((node, whole)),
        _ => None,
    });
    assert_eq!(probes, vec![(4, true)]);
    r.after(Instant::now());
    assert!(prefills(&mut r).iter().all(|p| p.2 != 4), "nothing more goes to node 4");
    // Back with every stage: it prefills again.
    r.back(4, LlmMsg::State { role: Role::Prefill, resident: 4, layers: 4, running: 0, free_pages: 0 });
    for id in 10..16 {
        request(&mut r, id);
    }
    assert!(prefills(&mut r).iter().any(|p| p.2 == 4), "node 4 prefills again");
}

fn mutations(r: &mut Routing) -> Vec<(u32, oneshot::Sender<Result<(), String>>)> {
    taken(r, |a| match a {
        Action::Mutate { node, done } => Some((node, done)),
        _ => None,
    })
}

fn lost(peer: u32) -> PeerEvent {
    PeerEvent::Down { peer, reason: "killed".into(), graceful: false }
}

#[test]
fn a_lost_decode_instance_is_replaced_by_a_spare_prefill_instance_and_never_by_the_last() {
    // Prefill instances 1 (old) and 4, decode instances 2 and 3.
    let (mut r, _answers) = routing(vec![4]);
    r.cfg.replace_lost_decode = true;
    r.after(Instant::now());
    assert!(mutations(&mut r).is_empty(), "nothing is lost: nothing mutates");
    // Node 1's prefills answer, node 4's do not: node 4 is busier, and node 1 is the one spared.
    request(&mut r, 1);
    request(&mut r, 2);
    request(&mut r, 3);
    let sent = prefills(&mut r);
    assert!(sent.iter().any(|p| p.2 == 4), "{sent:?}");
    for &(id, attempt, _) in sent.iter().filter(|p| p.2 == 1) {
        r.prefilled(id, attempt, decoding(2, attempt));
    }
    r.peer_event(lost(3));
    r.after(Instant::now());
    let m = mutations(&mut r);
    assert_eq!(m.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1], "the least busy prefill instance mutates");
    assert_eq!(r.stats.decode_replaced, 1);
    r.after(Instant::now());
    assert!(mutations(&mut r).is_empty(), "one replacement at a time");
    let (node, done) = m.into_iter().next().unwrap();
    r.mutated(node, Ok(()), done);
    assert_eq!(r.decode, vec![2, 1]);
    for id in 10..14 {
        request(&mut r, id);
    }
    assert!(prefills(&mut r).iter().all(|p| p.2 == 4), "node 1 prefills no more");
    // Another decode instance lost: node 4 is the last prefill instance, so it stays one.
    r.peer_event(lost(2));
    r.after(Instant::now());
    assert!(mutations(&mut r).is_empty(), "the last prefill instance never mutates");
    assert_eq!(r.stats.decode_replaced, 1);
}

#[test]
fn a_replacement_waits_for_a_loading_instance_and_spares_its_pair() {
    // Prefill instances 1 (old) and 0, decode 2 and 3; node 4 scales out from node 1. Idle
    // alike, the highest would go: node 1, were it not paired with node 4.
    let (mut r, _answers) = routing(vec![0]);
    r.cfg.replace_lost_decode = true;
    r.command(PdCmd::Scaling { node: 4 });
    r.peer_event(lost(2));
    r.after(Instant::now());
    let m = mutations(&mut r);
    assert_eq!(m.iter().map(|x| x.0).collect::<Vec<_>>(), vec![0], "node 1 is paired with loading node 4");
    // The switch fails: node 0 is asked what it is, and taken back as a prefill instance.
    let (node, done) = m.into_iter().next().unwrap();
    r.mutated(node, Err("timed out".into()), done);
    let probes = taken(&mut r, |a| match a {
        Action::Probe { node, .. } => Some(node),
        _ => None,
    });
    assert_eq!(probes, vec![0]);
    r.back(0, LlmMsg::State { role: Role::Prefill, resident: 4, layers: 4, running: 0, free_pages: 0 });
    // Node 4 holds every stage now: 0, 1 and 4 prefill, idle alike, and the highest goes.
    r.resident(4, 4);
    r.after(Instant::now());
    assert_eq!(mutations(&mut r).iter().map(|x| x.0).collect::<Vec<_>>(), vec![4]);
    assert_eq!(r.stats.decode_replaced, 2);
}

#[test]
fn tokens_of_an_attempt_whose_call_failed_are_not_part_of_the_redone_answer() {
    let (mut r, mut answers) = routing(vec![]);
    request(&mut r, 1);
    prefills(&mut r);
    // Attempt 1's decode started and streamed three tokens; then its call timed out.
    for i in 1..=3 {
        r.message(2, token(1, 1, i, 100 + i, false));
    }
    let timeout = ServeError::Peer("prefill call timed out".into());
    r.prefilled(1, 1, Outcome::Failed(timeout));
    r.after(Instant::now());
    assert_eq!(prefills(&mut r), vec![(1, 2, 1)]);
    // Attempt 2 ends at its first decoded token.
    r.prefilled(1, 2, decoding(3, 2));
    r.message(3, token(1, 2, 1, 8, true));
    r.after(Instant::now());
    let a = answers.try_recv().unwrap();
    assert_eq!((a.result, a.gaps.len(), a.attempts), (Ok(vec![7, 8]), 1, 2));
}

#[test]
fn back_pressure_retries_without_spending_attempts() {
    let (mut r, _answers) = routing(vec![]);
    request(&mut r, 1);
    prefills(&mut r);
    for attempt in 2..10 {
        r.prefilled(1, attempt - 1, Outcome::Busy("full".into()));
        r.after(Instant::now());
        assert_eq!(prefills(&mut r), vec![(1, attempt, 1)]);
    }
    assert_eq!((r.stats.failed, r.stats.requeued), (0, 0));
}

/// A word-level tokenizer of the words `t0`…`t11`: token `i` reads `ti`, tokens joined by spaces.
fn words() -> std::sync::Arc<tokenizers::Tokenizer> {
    let vocab: serde_json::Map<String, serde_json::Value> = (0..12).map(|i| (format!("t{i}"), i.into())).collect();
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}
    });
    std::sync::Arc::new(tokenizers::Tokenizer::from_bytes(json.to_string().as_bytes()).unwrap())
}

fn stopping(r: &mut Routing, id: u64, stop: &[&str]) {
    let stop = crate::llama::stop::StopStrings::new(stop.iter().map(|s| s.to_string()).collect()).unwrap();
    r.arrive(GenRequest { id, prompt: vec![1, 2, 3], max_tokens: 9, adapter: 0, sample: None, stop, tokens: None });
}

fn stops(r: &mut Routing) -> Vec<(u32, u64, u64)> {
    taken(r, |a| match a {
        Action::Stop { node, req, lease } => Some((node, req, lease)),
        _ => None,
    })
}

/// The router ends an answer at the first token whose text completes one of its stop strings —
/// checked in the answer's order, whatever order the tokens arrive in; the first token counts —
/// and tells its decode to stop, unless the instance ended it there itself; tokens past the stop
/// are not taken. Without a tokenizer, stop strings are refused.
#[test]
fn a_stop_string_ends_the_answer_and_its_decode() {
    let (mut r, mut answers) = routing(vec![]);
    stopping(&mut r, 4, &["t8"]);
    let refused = answers.try_recv().unwrap();
    assert!(refused.result.unwrap_err().contains("no tokenizer"));
    r.cfg.tokenizer = Some(words());
    stopping(&mut r, 5, &["t8 t9", "t11"]);
    stopping(&mut r, 6, &["t7"]);
    stopping(&mut r, 7, &["t9"]);
    assert_eq!(prefills(&mut r), [(5, 1, 1), (6, 1, 1)]);
    r.prefilled(5, 1, decoding(2, 1));
    // Request 6's first token is its stop: answered with it; its decode (node 3) stopped.
    r.prefilled(6, 1, decoding(3, 1));
    assert_eq!(stops(&mut r), [(3, 6, 41)]);
    assert_eq!(prefills(&mut r), [(7, 1, 1)]);
    r.prefilled(7, 1, decoding(3, 1));
    // Request 5: "t9" before "t8" reads no stop yet; "t8" completes "t8 t9", and "t10" that came
    // meanwhile is dropped.
    r.message(2, token(5, 1, 2, 9, false));
    r.message(2, token(5, 1, 3, 10, false));
    assert!(stops(&mut r).is_empty());
    r.message(2, token(5, 1, 1, 8, false));
    assert_eq!(stops(&mut r), [(2, 5, 41)]);
    // Request 7 ends at "t9" as the instance ends it: nothing to stop.
    r.message(3, token(7, 1, 1, 8, false));
    r.message(3, token(7, 1, 2, 9, true));
    assert!(stops(&mut r).is_empty());
    r.after(Instant::now());
    let mut got: Vec<(u64, Vec<u32>, bool)> =
        std::iter::from_fn(|| answers.try_recv().ok()).map(|a| (a.id, a.result.unwrap(), a.stopped)).collect();
    got.sort();
    assert_eq!(got, [(5, vec![7, 8, 9], true), (6, vec![7], true), (7, vec![7, 8, 9], true)]);
    assert_eq!(r.stats.stopped, 3);
    // A token decoded before the stop came: stale, its decode told to stop again.
    r.message(2, token(5, 1, 4, 11, false));
    assert_eq!((stops(&mut r), r.stats.stale_tokens), (vec![(2, 5, 41)], 1));
}

/// A request that streams, with its channel.
fn streaming(r: &mut Routing, id: u64, stop: &[&str]) -> mpsc::UnboundedReceiver<u32> {
    let stop = crate::llama::stop::StopStrings::new(stop.iter().map(|s| s.to_string()).collect()).unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    let tokens = Some(super::super::TokenSink(tx));
    r.arrive(GenRequest { id, prompt: vec![1, 2, 3], max_tokens: 9, adapter: 0, sample: None, stop, tokens });
    rx
}

fn drained(rx: &mut mpsc::UnboundedReceiver<u32>) -> Vec<u32> {
    std::iter::from_fn(|| rx.try_recv().ok()).collect()
}

/// A streamed answer's tokens go out in the answer's order, each once, whatever order they
/// arrive in; none past a stop string.
#[test]
fn a_streamed_answer_goes_out_in_order_each_token_once_and_none_past_a_stop() {
    let (mut r, mut answers) = routing(vec![]);
    r.cfg.tokenizer = Some(words());
    let mut rx = streaming(&mut r, 5, &["t10"]);
    assert_eq!(prefills(&mut r), [(5, 1, 1)]);
    r.prefilled(5, 1, decoding(2, 1));
    assert_eq!(drained(&mut rx), [7]);
    r.message(2, token(5, 1, 2, 9, false));
    assert_eq!(drained(&mut rx), [] as [u32; 0], "token 2 waits for token 1");
    r.message(2, token(5, 1, 1, 8, false));
    assert_eq!(drained(&mut rx), [8, 9]);
    r.message(2, token(5, 1, 4, 11, false));
    r.message(2, token(5, 1, 3, 10, false));
    assert_eq!(drained(&mut rx), [10], "t10 ends it: t11 is not streamed");
    r.after(Instant::now());
    assert_eq!(answers.try_recv().unwrap().result, Ok(vec![7, 8, 9, 10]));
}

/// A request redone after its decode instance was lost streams only what the first attempt had
/// not; an attempt whose tokens differ from those streamed ends it with an error (and its decode).
#[test]
fn a_redone_stream_repeats_nothing_and_one_that_diverges_fails() {
    let (mut r, mut answers) = routing(vec![]);
    let mut rx = streaming(&mut r, 5, &[]);
    let mut other = streaming(&mut r, 6, &[]);
    assert_eq!(prefills(&mut r), [(5, 1, 1), (6, 1, 1)]);
    r.prefilled(5, 1, decoding(2, 1));
    r.prefilled(6, 1, decoding(2, 1));
    r.message(2, token(5, 1, 1, 8, false));
    r.message(2, token(6, 1, 1, 8, false));
    assert_eq!((drained(&mut rx), drained(&mut other)), (vec![7, 8], vec![7, 8]));
    r.peer_event(lost(2));
    // Redone in the order the lost node's requests are found (a map's).
    let mut redone = prefills(&mut r);
    redone.sort();
    assert_eq!(redone, [(5, 2, 1), (6, 2, 1)]);
    r.prefilled(5, 2, decoding(3, 2));
    r.prefilled(6, 2, decoding(3, 2));
    r.message(3, token(5, 2, 1, 8, false));
    r.message(3, token(5, 2, 2, 9, true));
    assert_eq!(drained(&mut rx), [9]);
    // Request 6's second attempt gives 5 where 8 was streamed.
    stops(&mut r);
    r.message(3, token(6, 2, 1, 5, false));
    assert_eq!(stops(&mut r), [(3, 6, 42)]);
    r.after(Instant::now());
    let mut got: Vec<(u64, Result<Vec<u32>, String>)> =
        std::iter::from_fn(|| answers.try_recv().ok()).map(|a| (a.id, a.result)).collect();
    got.sort();
    assert_eq!(got[0], (5, Ok(vec![7, 8, 9])));
    assert!(got[1].0 == 6 && got[1].1.as_ref().unwrap_err().contains("differ"), "{got:?}");
    assert_eq!((r.stats.diverged, r.stats.failed, r.stats.answered), (1, 1, 1));
    assert!(drained(&mut other).is_empty());
}

/// A cancelled request is answered at once; queued, it is never prefilled; decoding, its decode
/// is told to stop; prefilling, its decode is stopped when the prefill answers. The dispatcher
/// holds none of them afterwards.
#[test]
fn a_cancelled_request_is_answered_at_once_and_its_work_stopped_wherever_it_is() {
    let (mut r, mut answers) = routing(vec![]);
    for id in 1..=4 {
        request(&mut r, id);
    }
    // Two at a time on node 1: 1 and 2 go, 3 and 4 wait.
    assert_eq!(prefills(&mut r), [(1, 1, 1), (2, 1, 1)]);
    r.prefilled(1, 1, decoding(2, 1));
    stops(&mut r);
    r.command(PdCmd::Cancel { id: 1 });
    assert_eq!(stops(&mut r), [(2, 1, 41)], "its decode stops");
    r.command(PdCmd::Cancel { id: 2 });
    assert!(stops(&mut r).is_empty(), "its prefill has not answered");
    r.command(PdCmd::Cancel { id: 3 });
    r.command(PdCmd::Cancel { id: 99 });
    let got: Vec<(u64, Result<Vec<u32>, String>)> =
        std::iter::from_fn(|| answers.try_recv().ok()).map(|a| (a.id, a.result)).collect();
    assert_eq!(got, [(1, Err("cancelled".into())), (2, Err("cancelled".into())), (3, Err("cancelled".into()))]);
    r.prefilled(2, 1, decoding(3, 1));
    assert_eq!(stops(&mut r), [(3, 2, 41)], "the cancelled prefill's decode stops");
    // Request 3 is skipped; 4 goes.
    assert_eq!(prefills(&mut r), [(4, 1, 1)]);
    assert_eq!(r.d.outstanding(), 1);
    r.message(2, token(1, 1, 1, 8, false));
    assert_eq!((r.stats.stale_tokens, stops(&mut r)), (1, vec![(2, 1, 41)]));
    assert_eq!((r.stats.cancelled, r.stats.failed), (3, 0));
}
