//! The simulation's state and its event loop (no clock: time is the next event's).

use std::collections::{BTreeMap, VecDeque};

use cascade_multicast::planner::{plan, PlannerKind, Request as PlanRequest};
use cascade_multicast::{Loc, Topology};

use super::autoscale::{wanted, Load, WINDOW_S};
use super::report::{Histogram, SimReport, TimelinePoint};
use super::{OverContext, SimConfig, System, TraceRequest};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Prefill,
    Decode,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Phase {
    /// Parameters arriving: started at `from`, complete at `until`.
    Loading {
        from: f64,
        until: f64,
    },
    Ready,
}

struct Inst {
    role: Role,
    host: usize,
    gpus: Vec<u32>,
    phase: Phase,
    /// End of the current prefill batch or decode iteration.
    busy_until: Option<f64>,
    /// Requests of the current prefill batch, or the running decode sequences.
    work: Vec<usize>,
    /// KV tokens of the running sequences (decode).
    kv_tokens: u64,
    /// When it last had nothing to do.
    idle_since: f64,
    /// A loading instance this (old, serving) one cooperates with (blitz's live scaling).
    partner: Option<usize>,
    /// Becomes a decode instance when its current batch ends (blitz's mutation).
    mutate: bool,
    released: bool,
}

struct Req {
    t: TraceRequest,
    first_token: Option<f64>,
    last_token: f64,
    generated: u64,
    gaps_ms: f64,
    gaps: u64,
}

/// The whole simulation.
pub(super) struct Sim<'a> {
    cfg: &'a SimConfig,
    /// Requests of the trace longer than the context window (refused ones are not in `reqs`).
    over_context: usize,
    topo: Topology,
    now: f64,
    reqs: Vec<Req>,
    next_arrival: usize,
    prefill_queue: VecDeque<usize>,
    /// Sequences whose KV is in transfer, by the time it lands.
    in_transfer: BTreeMap<(u64, usize), usize>,
    decode_queue: VecDeque<usize>,
    insts: Vec<Inst>,
    /// Per host: GPUs in use.
    used: Vec<Vec<bool>>,
    /// sllm: per host, its cached copy's (arrival, last use) (`None`: never had one).
    cache: Vec<Option<(f64, f64)>>,
    recent: VecDeque<(f64, u64)>,
    next_tick: f64,
    done: usize,
    // Measurements.
    ttft: Histogram,
    tbt: Histogram,
    slo_met: usize,
    gpu_ms: f64,
    peak_gpus: usize,
    cache_copy_ms: f64,
    last_account: f64,
    scale_events: usize,
    mutations: usize,
    live_scales: usize,
    load_ms: Histogram,
    hits: usize,
    misses: usize,
    timeline: Vec<TimelinePoint>,
    bin_prefill: u64,
    bin_decode: u64,
    next_bin: f64,
}

const TICK_MS: f64 = 100.0;
const POOL_HOST: usize = 0;

impl<'a> Sim<'a> {
    /// Serves `trace`, already fitted to the context window, where `over_context` requests
    /// did not fit as they came.
    pub(super) fn new(cfg: &'a SimConfig, trace: &[TraceRequest], over_context: usize) -> Result<Sim<'a>, String> {
        let hw = &cfg.hardware;
        if hw.hosts == 0 || hw.gpus_per_host < cfg.profile.gpus_per_instance {
            return Err(format!(
                "{} hosts of {} GPUs cannot hold a {}-GPU instance",
                hw.hosts, hw.gpus_per_host, cfg.profile.gpus_per_instance
            ));
        }
        // The simulated cluster is built whole (a topology, per-GPU state): `--hosts 100000000`
        // asked for gigabytes before anything ran. The batch simulators' bound.
        let gpus = hw.hosts.saturating_mul(hw.gpus_per_host);
        if gpus > cascade_sched::scenario::MAX_GPUS {
            return Err(format!(
                "{} hosts of {} GPUs are {gpus} GPUs; the simulator takes at most {}",
                hw.hosts,
                hw.gpus_per_host,
                cascade_sched::scenario::MAX_GPUS
            ));
        }
        let mut toml = String::new();
        for h in 0..hw.hosts {
            let nics: Vec<String> = (0..hw.gpus_per_host).map(|g| format!("[{g}]")).collect();
            toml += &format!(
                "[[nodes]]\nid = {h}\ngpus = {}\nnic_gbps = {}\nnvlink = true\nnvlink_gbps = {}\npcie_gbps = {}\nnics = [{}]\n",
                hw.gpus_per_host,
                hw.rdma_gbps,
                hw.nvlink_gbps,
                hw.pcie_gbps,
                nics.join(", ")
            );
        }
        let topo = Topology::from_toml(&toml).map_err(|e| format!("the simulated cluster: {e}"))?;
        let reqs = trace
            .iter()
            .map(|&t| Req { t, first_token: None, last_token: 0.0, generated: 0, gaps_ms: 0.0, gaps: 0 })
            .collect();
        let mut s = Sim {
            cfg,
            over_context,
            topo,
            now: 0.0,
            reqs,
            next_arrival: 0,
            prefill_queue: VecDeque::new(),
            in_transfer: BTreeMap::new(),
            decode_queue: VecDeque::new(),
            insts: Vec::new(),
            used: vec![vec![false; hw.gpus_per_host]; hw.hosts],
            cache: vec![None; hw.hosts],
            recent: VecDeque::new(),
            next_tick: 0.0,
            done: 0,
            ttft: Histogram::default(),
            tbt: Histogram::default(),
            slo_met: 0,
            gpu_ms: 0.0,
            peak_gpus: 0,
            cache_copy_ms: 0.0,
            last_account: 0.0,
            scale_events: 0,
            mutations: 0,
            live_scales: 0,
            load_ms: Histogram::default(),
            hits: 0,
            misses: 0,
            timeline: Vec::new(),
            bin_prefill: 0,
            bin_decode: 0,
            next_bin: cfg.timeline_bin_ms,
        };
        // The starting deployment: instances already loaded (and, for sllm, the cache they came
        // from; the pool's copy for blitz and stop lives on host 0).
        for (role, n) in [(Role::Prefill, cfg.initial.0), (Role::Decode, cfg.initial.1)] {
            for _ in 0..n {
                let (host, gpus) = s.place(&[]).ok_or("the cluster cannot hold the starting instances")?;
                s.add(role, host, gpus, Phase::Ready);
                s.cache[host] = Some((0.0, 0.0));
            }
        }
        Ok(s)
    }

    fn add(&mut self, role: Role, host: usize, gpus: Vec<u32>, phase: Phase) -> usize {
        for &g in &gpus {
            self.used[host][g as usize] = true;
        }
        self.insts.push(Inst {
            role,
            host,
            gpus,
            phase,
            busy_until: None,
            work: Vec::new(),
            kv_tokens: 0,
            idle_since: self.now,
            partner: None,
            mutate: false,
            released: false,
        });
        self.insts.len() - 1
    }

    /// GPUs for a new instance on one host, preferring `hosts` in order, then the host with most
    /// free GPUs.
    fn place(&self, prefer: &[usize]) -> Option<(usize, Vec<u32>)> {
        let need = self.cfg.profile.gpus_per_instance;
        let free = |h: usize| -> Vec<u32> {
            (0..self.used[h].len()).filter(|&g| !self.used[h][g]).map(|g| g as u32).collect()
        };
        let mut order: Vec<usize> = prefer.to_vec();
        let mut rest: Vec<usize> = (0..self.used.len()).filter(|h| !prefer.contains(h)).collect();
        rest.sort_by_key(|&h| std::cmp::Reverse(free(h).len()));
        order.extend(rest);
        order.into_iter().find_map(|h| {
            let f = free(h);
            (f.len() >= need).then(|| (h, f[..need].to_vec()))
        })
    }

    fn live(&self) -> impl Iterator<Item = (usize, &Inst)> {
        self.insts.iter().enumerate().filter(|(_, i)| !i.released)
    }

    fn ready(&self, role: Role) -> usize {
        self.live().filter(|(_, i)| i.role == role && i.phase == Phase::Ready && !i.mutate).count()
    }

    fn count(&self, role: Role) -> usize {
        self.live().filter(|(_, i)| i.role == role && !i.mutate).count()
    }

    /// Whether host `h` holds a copy of the model in its memory now.
    fn cache_alive(&self, h: usize) -> bool {
        match self.cfg.system {
            System::Allcache => true,
            System::Sllm => self.cache[h].is_some_and(|(ready, _)| ready <= self.now) && self.cache_kept(h),
            System::Blitz | System::Stop | System::Instant => h == POOL_HOST,
        }
    }

    /// sllm: whether host `h`'s copy (arrived or arriving) is within its keep-alive.
    fn cache_kept(&self, h: usize) -> bool {
        self.cache[h].is_some_and(|(ready, used)| ready > self.now || self.now - used <= self.cfg.keep_alive_s * 1e3)
    }

    /// Runs to the end of the trace; the report and the timeline.
    pub(super) fn run(mut self) -> (SimReport, Vec<TimelinePoint>, Histogram, Histogram) {
        while self.done < self.reqs.len() {
            let next = self.next_event();
            self.account(next);
            self.now = next;
            self.step();
        }
        self.account(self.now);
        self.report()
    }

    fn next_event(&self) -> f64 {
        let mut t = self.next_tick;
        if let Some(r) = self.reqs.get(self.next_arrival) {
            t = t.min(r.t.at_ms);
        }
        if let Some((&(at, _), _)) = self.in_transfer.iter().next() {
            t = t.min(at as f64 / 1e3);
        }
        for (_, i) in self.live() {
            if let Some(b) = i.busy_until {
                t = t.min(b);
            }
            if let Phase::Loading { until, .. } = i.phase {
                t = t.min(until);
            }
        }
        t.max(self.now)
    }

    /// GPU time and host-cache time up to `to`.
    fn account(&mut self, to: f64) {
        let dt = to - self.last_account;
        if dt > 0.0 {
            let gpus: usize = self.live().map(|(_, i)| i.gpus.len()).sum();
            self.gpu_ms += dt * gpus as f64;
            self.peak_gpus = self.peak_gpus.max(gpus);
            let copies = (0..self.cfg.hardware.hosts).filter(|&h| self.cache_alive(h)).count();
            self.cache_copy_ms += dt * copies as f64;
        }
        self.last_account = to;
        while to >= self.next_bin {
            let bin_s = self.cfg.timeline_bin_ms / 1e3;
            self.timeline.push(TimelinePoint {
                t_s: self.next_bin / 1e3,
                prefill_tokens_per_s: self.bin_prefill as f64 / bin_s,
                decode_tokens_per_s: self.bin_decode as f64 / bin_s,
                prefill_instances: self.ready(Role::Prefill),
                decode_instances: self.ready(Role::Decode),
                loading: self.live().filter(|(_, i)| matches!(i.phase, Phase::Loading { .. })).count(),
            });
            self.bin_prefill = 0;
            self.bin_decode = 0;
            self.next_bin += self.cfg.timeline_bin_ms;
        }
    }

    fn step(&mut self) {
        let now = self.now;
        while let Some(r) = self.reqs.get(self.next_arrival).filter(|r| r.t.at_ms <= now) {
            self.recent.push_back((r.t.at_ms, r.t.prompt_tokens));
            self.prefill_queue.push_back(self.next_arrival);
            self.next_arrival += 1;
        }
        for k in 0..self.insts.len() {
            let i = &mut self.insts[k];
            if i.released {
                continue;
            }
            if let Phase::Loading { until, .. } = i.phase {
                if until <= now {
                    i.phase = Phase::Ready;
                    i.idle_since = now;
                    for o in &mut self.insts {
                        if o.partner == Some(k) {
                            o.partner = None;
                        }
                    }
                }
            }
            if self.insts[k].busy_until.is_some_and(|b| b <= now) {
                self.finish_work(k);
            }
        }
        while let Some((&key, &r)) = self.in_transfer.iter().next() {
            if key.0 as f64 / 1e3 > now {
                break;
            }
            self.in_transfer.remove(&key);
            self.decode_queue.push_back(r);
        }
        if now >= self.next_tick {
            self.autoscale();
            self.next_tick = now + TICK_MS;
        }
        self.dispatch();
    }

    fn finish_work(&mut self, k: usize) {
        let now = self.now;
        let work = std::mem::take(&mut self.insts[k].work);
        self.insts[k].busy_until = None;
        self.insts[k].idle_since = now;
        let h = self.insts[k].host;
        if self.cache_alive(h) {
            self.cache[h] = self.cache[h].map(|(ready, _)| (ready, now));
        }
        match self.insts[k].role {
            Role::Prefill => {
                for r in work {
                    let rq = &mut self.reqs[r];
                    rq.first_token = Some(now);
                    rq.last_token = now;
                    rq.generated = 1;
                    self.bin_prefill += rq.t.prompt_tokens;
                    self.ttft.push(now - rq.t.at_ms);
                    if rq.t.output_tokens <= 1 {
                        self.complete(r);
                    } else {
                        let bits = (rq.t.prompt_tokens * self.cfg.profile.kv_bytes_per_token) as f64 * 8.0;
                        let at = now + bits / (self.cfg.hardware.rdma_gbps * 1e6);
                        self.in_transfer.insert(((at * 1e3).ceil() as u64, r), r);
                    }
                }
                if self.insts[k].mutate {
                    let i = &mut self.insts[k];
                    i.mutate = false;
                    i.role = Role::Decode;
                }
            }
            Role::Decode => {
                let mut keep = Vec::with_capacity(work.len());
                for r in work {
                    let rq = &mut self.reqs[r];
                    rq.gaps_ms += now - rq.last_token;
                    rq.gaps += 1;
                    self.tbt.push(now - rq.last_token);
                    rq.last_token = now;
                    rq.generated += 1;
                    self.bin_decode += 1;
                    if rq.generated >= rq.t.output_tokens {
                        self.insts[k].kv_tokens -= rq.t.prompt_tokens + rq.t.output_tokens;
                        self.complete(r);
                    } else {
                        keep.push(r);
                    }
                }
                self.insts[k].work = keep;
            }
        }
    }

    fn complete(&mut self, r: usize) {
        let rq = &self.reqs[r];
        let p = &self.cfg.profile;
        let ttft_ok = rq.first_token.is_some_and(|f| f - rq.t.at_ms <= p.ttft_slo_ms);
        let tbt_ok = rq.gaps == 0 || rq.gaps_ms / rq.gaps as f64 <= p.tbt_slo_ms;
        if ttft_ok && tbt_ok {
            self.slo_met += 1;
        }
        self.done += 1;
    }

    /// The pipeline speed-up of an old prefill instance whose partner has a fraction of its layers.
    fn coop_factor(&self, k: usize) -> f64 {
        match self.insts[k].partner.map(|n| self.insts[n].phase) {
            Some(Phase::Loading { from, until }) => {
                let f = ((self.now - from) / (until - from).max(1e-9)).clamp(0.0, 1.0);
                1.0 - f.min(0.5)
            }
            _ => 1.0,
        }
    }

    fn dispatch(&mut self) {
        let now = self.now;
        let p = self.cfg.profile.clone();
        for k in 0..self.insts.len() {
            let i = &self.insts[k];
            if i.released || i.phase != Phase::Ready || i.busy_until.is_some() {
                continue;
            }
            match i.role {
                Role::Prefill => {
                    let mut tokens = 0;
                    let mut batch = Vec::new();
                    while let Some(&r) = self.prefill_queue.front() {
                        let t = self.reqs[r].t.prompt_tokens;
                        if !batch.is_empty() && tokens + t > p.max_prefill_tokens {
                            break;
                        }
                        tokens += t;
                        batch.push(r);
                        self.prefill_queue.pop_front();
                    }
                    if !batch.is_empty() {
                        let d = p.prefill_ms(tokens) * self.coop_factor(k);
                        let i = &mut self.insts[k];
                        i.work = batch;
                        i.busy_until = Some(now + d);
                    }
                }
                Role::Decode => {
                    let cap = p.decode_target_batch();
                    let mut admitted = Vec::new();
                    let mut kv = i.kv_tokens;
                    let mut n = i.work.len();
                    while let Some(&r) = self.decode_queue.front() {
                        let need = self.reqs[r].t.prompt_tokens + self.reqs[r].t.output_tokens;
                        if n >= cap || kv + need > p.kv_capacity_tokens {
                            break;
                        }
                        kv += need;
                        n += 1;
                        admitted.push(r);
                        self.decode_queue.pop_front();
                    }
                    let i = &mut self.insts[k];
                    i.work.extend(admitted);
                    i.kv_tokens = kv;
                    if !i.work.is_empty() {
                        i.busy_until = Some(now + p.decode_ms(i.work.len()));
                    }
                }
            }
        }
    }

    fn autoscale(&mut self) {
        let now = self.now;
        while self.recent.front().is_some_and(|&(t, _)| t < now - WINDOW_S * 1e3) {
            self.recent.pop_front();
        }
        let decode_seqs = self.decode_queue.len()
            + self.in_transfer.len()
            + self.live().filter(|(_, i)| i.role == Role::Decode).map(|(_, i)| i.work.len()).sum::<usize>();
        let load = Load {
            recent_prompt_tokens: self.recent.iter().map(|&(_, t)| t).sum(),
            backlog_tokens: self.prefill_queue.iter().map(|&r| self.reqs[r].t.prompt_tokens).sum(),
            decode_seqs,
        };
        let (want_p, want_d) = wanted(&self.cfg.profile, self.cfg.prefill_utilisation, load);
        // Decode first: blitz mutates spare prefill instances (they keep their parameters).
        let mut short_d = want_d.saturating_sub(self.count(Role::Decode));
        if self.cfg.system == System::Blitz && short_d > 0 {
            let spare = self.ready(Role::Prefill).saturating_sub(want_p);
            let mut cands: Vec<usize> = self
                .live()
                .filter(|(_, i)| i.role == Role::Prefill && i.phase == Phase::Ready && !i.mutate)
                .map(|(k, _)| k)
                .collect();
            cands.sort_by_key(|&k| self.insts[k].busy_until.is_some());
            for k in cands.into_iter().take(spare.min(short_d)) {
                let i = &mut self.insts[k];
                if i.busy_until.is_some() {
                    i.mutate = true;
                } else {
                    i.role = Role::Decode;
                }
                i.partner = None;
                self.mutations += 1;
                self.scale_events += 1;
                short_d -= 1;
            }
        }
        let short_p = want_p.saturating_sub(self.count(Role::Prefill));
        let mut new = Vec::new();
        for (role, n) in [(Role::Prefill, short_p), (Role::Decode, short_d)] {
            for _ in 0..n {
                let prefer = self.preferred_hosts();
                let Some((host, gpus)) = self.place(&prefer) else { break };
                let k = self.add(role, host, gpus, Phase::Loading { from: now, until: f64::INFINITY });
                new.push(k);
            }
        }
        if !new.is_empty() {
            self.start_loads(&new);
        }
        self.scale_in(want_p, want_d);
    }

    fn preferred_hosts(&self) -> Vec<usize> {
        let mut hosts: Vec<usize> = (0..self.cfg.hardware.hosts).collect();
        match self.cfg.system {
            System::Sllm => hosts.retain(|&h| self.cache_alive(h)),
            System::Blitz | System::Stop => {
                // Next to a GPU copy (NVLink), then next to the pool's host copy.
                hosts.retain(|&h| self.live().any(|(_, i)| i.host == h && i.phase == Phase::Ready));
                if !hosts.contains(&POOL_HOST) {
                    hosts.push(POOL_HOST);
                }
            }
            System::Allcache | System::Instant => hosts.clear(),
        }
        hosts
    }

    /// Sets the load time of the instances `new` just placed, by the system's path.
    fn start_loads(&mut self, new: &[usize]) {
        let now = self.now;
        let hw = self.cfg.hardware.clone();
        let shard_bits = self.cfg.profile.param_bytes as f64 * 8.0 / self.cfg.profile.gpus_per_instance as f64;
        let mut done: Vec<f64> = Vec::with_capacity(new.len());
        match self.cfg.system {
            System::Allcache | System::Sllm => {
                for &k in new {
                    let h = self.insts[k].host;
                    let pcie = shard_bits / (hw.pcie_gbps * 1e6);
                    if self.cfg.system == System::Allcache {
                        self.hits += 1;
                        done.push(pcie);
                    } else if let Some((ready, _)) = self.cache[h].filter(|_| self.cache_kept(h)) {
                        // A hit, or a copy still arriving from SSD for another instance: wait for it.
                        self.hits += 1;
                        done.push((ready - now - hw.startup_ms).max(0.0) + pcie);
                    } else {
                        // A miss: from SSD, which leaves a copy in the host's memory.
                        self.misses += 1;
                        let d = shard_bits / (hw.ssd_gbps * 1e6);
                        let ready = now + hw.startup_ms + d;
                        self.cache[h] = Some((ready, ready));
                        done.push(d);
                    }
                }
            }
            System::Blitz | System::Stop => done = self.multicast(new, shard_bits / 8.0),
            System::Instant => done = vec![0.0; new.len()],
        }
        let startup_ms = if self.cfg.system == System::Instant { 0.0 } else { hw.startup_ms };
        for (&k, d) in new.iter().zip(done) {
            let until = now + startup_ms + d;
            self.insts[k].phase = Phase::Loading { from: now + startup_ms, until };
            self.load_ms.push(until - now);
            self.scale_events += 1;
            if self.cfg.system == System::Blitz && self.insts[k].role == Role::Prefill {
                let old = self
                    .live()
                    .find(|(o, i)| {
                        *o != k
                            && i.role == Role::Prefill
                            && i.phase == Phase::Ready
                            && i.partner.is_none()
                            && !i.mutate
                    })
                    .map(|(o, _)| o);
                if let Some(o) = old {
                    self.insts[o].partner = Some(k);
                    self.live_scales += 1;
                }
            }
        }
    }

    /// Load times (ms) of `new` by multicast from every GPU holding the model and the pool's
    /// host copy, one plan per tensor-parallel shard, by the real planner.
    fn multicast(&self, new: &[usize], shard_bytes: f64) -> Vec<f64> {
        let tp = self.cfg.profile.gpus_per_instance;
        let mut out = vec![0.0f64; new.len()];
        for s in 0..tp {
            let mut sources: Vec<Loc> = self
                .live()
                .filter(|(_, i)| i.phase == Phase::Ready)
                .map(|(_, i)| Loc::gpu(i.host as u32, i.gpus[s]))
                .collect();
            sources.push(Loc::host(POOL_HOST as u32));
            let targets: Vec<Loc> =
                new.iter().map(|&k| Loc::gpu(self.insts[k].host as u32, self.insts[k].gpus[s])).collect();
            let req = PlanRequest { bytes: shard_bytes as u64, sources, targets: targets.clone() };
            let predicted: Vec<f64> = match plan(&self.topo, &req, PlannerKind::Blitz) {
                Ok(p) => targets
                    .iter()
                    .map(|t| p.predicted.iter().find(|(l, _)| l == t).map_or(p.makespan(), |x| x.1))
                    .collect(),
                // A planner failure falls back to loading everything from the pool host over RDMA.
                Err(_) => vec![shard_bytes * 8.0 / (self.cfg.hardware.rdma_gbps * 1e9); targets.len()],
            };
            for (o, t) in out.iter_mut().zip(predicted) {
                *o = o.max(t * 1e3);
            }
        }
        out
    }

    fn scale_in(&mut self, want_p: usize, want_d: usize) {
        let now = self.now;
        let idle_ms = self.cfg.scale_in_idle_s * 1e3;
        for (role, want) in [(Role::Prefill, want_p), (Role::Decode, want_d)] {
            let mut extra = self.count(role).saturating_sub(want);
            for k in 0..self.insts.len() {
                if extra == 0 {
                    break;
                }
                let i = &self.insts[k];
                let idle = !i.released
                    && i.role == role
                    && i.phase == Phase::Ready
                    && i.busy_until.is_none()
                    && i.work.is_empty()
                    && !i.mutate
                    && now - i.idle_since >= idle_ms
                    && !self.insts.iter().any(|o| !o.released && o.partner == Some(k));
                if idle {
                    let i = &mut self.insts[k];
                    i.released = true;
                    i.partner = None;
                    for &g in &i.gpus.clone() {
                        self.used[i.host][g as usize] = false;
                    }
                    extra -= 1;
                }
            }
        }
    }

    fn report(mut self) -> (SimReport, Vec<TimelinePoint>, Histogram, Histogram) {
        // Refused requests arrived and were not served: each missed its SLO.
        let refused = if self.cfg.over_context == OverContext::Refuse { self.over_context } else { 0 };
        let arrived = self.reqs.len() + refused;
        let hosts_gb = self.cfg.profile.param_bytes as f64 / 1e9;
        let dur = self.now.max(1.0);
        let copies = self.cache_copy_ms / dur;
        let mut floor = Histogram::default();
        for r in &self.reqs {
            floor.push(self.cfg.profile.prefill_ms(r.t.prompt_tokens));
        }
        let r = SimReport {
            system: self.cfg.system,
            model: self.cfg.profile.name.to_string(),
            requests: self.reqs.len(),
            over_context: self.over_context,
            over_context_policy: self.cfg.over_context,
            prefill_utilisation: self.cfg.prefill_utilisation,
            ttft_p50_ms: self.ttft.quantile(0.5),
            ttft_p99_ms: self.ttft.quantile(0.99),
            ttft_mean_ms: self.ttft.mean(),
            ttft_floor_p99_ms: floor.quantile(0.99),
            tbt_p50_ms: self.tbt.quantile(0.5),
            tbt_p99_ms: self.tbt.quantile(0.99),
            tbt_mean_ms: self.tbt.mean(),
            slo_attainment: self.slo_met as f64 / arrived.max(1) as f64,
            gpu_seconds: self.gpu_ms / 1e3,
            peak_gpus: self.peak_gpus,
            gpus: self.cfg.hardware.hosts * self.cfg.hardware.gpus_per_host,
            host_cache_gb_avg: copies * hosts_gb,
            host_cache_copies_avg: copies,
            scale_events: self.scale_events,
            mutations: self.mutations,
            live_scales: self.live_scales,
            load_s_mean: self.load_ms.mean() / 1e3,
            cache_hits: self.hits,
            cache_misses: self.misses,
            duration_s: dur / 1e3,
        };
        (r, self.timeline, self.ttft, self.tbt)
    }
}
