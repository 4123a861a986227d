//! The verbs layer of the RDMA backend: device, memory registration, RC queue pairs and their
//! one-sided WRITE/READ, over `sideway`.
//!
//! Completions are reaped by one thread per queue pair that polls its completion queue and
//! resolves the matching [`OpHandle`]s. Every posted work request keeps its local [`Region`]
//! alive until its completion arrives (the DMA-lifetime rule).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use sideway::ibverbs::address::{AddressHandleAttribute, GidType};
use sideway::ibverbs::completion::{BasicCompletionQueue, PollCompletionQueueError};
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, Mtu};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState, SetScatterGatherEntry,
    WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;

use super::{ConnInfo, MrTable, RemoteMr};
use crate::error::{Result, TransportError};
use crate::link::{Completion, Done, OpHandle};
use crate::region::{Region, RegionId, RemoteKey};
use crate::wire::Status;
use crate::NodeId;

const PORT: u8 = 1;
const MAX_SEND_WR: u32 = 512;

fn err(context: &str, e: impl std::fmt::Display) -> TransportError {
    TransportError::io(format!("RDMA {context}"), std::io::Error::other(e.to_string()))
}

/// An opened RDMA device with its protection domain and the regions registered with it.
pub struct Device {
    ctx: Arc<DeviceContext>,
    pd: Arc<ProtectionDomain>,
    lid: u16,
    gid_index: u8,
    gid: [u8; 16],
    mrs: Mutex<MrTable<Arc<MemoryRegion>>>,
}

impl Device {
    /// Opens the named device (or the first one) and allocates a protection domain.
    pub fn open(name: Option<&str>) -> Result<Arc<Device>> {
        let none = |detail: String| TransportError::NoRdmaDevice { detail };
        let list = DeviceList::new().map_err(|e| none(format!("cannot list devices: {e}")))?;
        let dev = list.iter().find(|d| name.is_none_or(|n| d.name() == n)).ok_or_else(|| {
            none(match name {
                Some(n) => format!("no device named {n:?} among {} found", list.len()),
                None => "libibverbs found no device".into(),
            })
        })?;
        let ctx = dev.open().map_err(|e| none(format!("opening {}: {e}", dev.name())))?;
        let pd = ctx.alloc_pd().map_err(|e| err("allocating a protection domain", e))?;
        let port = ctx.query_port(PORT).map_err(|e| err("querying port 1", e))?;
        let gids = ctx.query_gid_table().map_err(|e| err("querying the GID table", e))?;
        let entry = gids
            .iter()
            .find(|g| {
                g.port_num() == u32::from(PORT)
                    && (!g.gid().is_unicast_link_local()
                        || matches!(g.gid_type(), GidType::RoceV1 | GidType::InfiniBand))
            })
            .ok_or_else(|| none(format!("{}: no usable GID on port {PORT}", dev.name())))?;
        Ok(Arc::new(Device {
            lid: port.lid(),
            gid_index: u8::try_from(entry.gid_index()).map_err(|_| err("GID index", "above 255"))?,
            gid: entry.gid().raw,
            ctx,
            pd,
            mrs: Mutex::new(MrTable::default()),
        }))
    }

    fn mrs(&self) -> std::sync::MutexGuard<'_, MrTable<Arc<MemoryRegion>>> {
        self.mrs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers `region` for local use and remote READ/WRITE; returns what peers need.
    pub fn register(&self, region: &Region) -> Result<RemoteMr> {
        let len = usize::try_from(region.len()).map_err(|_| err("registering", "region too large"))?;
        // SAFETY: the slice spans the whole region, which `Region` keeps allocated for as long as
        // the registration (held in `mrs` next to the region id) — `deregister` must run before a
        // region is dropped for good; posted work requests also hold the region.
        let addr = unsafe { region.slice(0, region.len()) }.as_ptr() as usize;
        // SAFETY: `addr..addr+len` is the live allocation of `region` (see above).
        let mr = unsafe {
            self.pd.reg_mr(addr, len, AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead)
        }
        .map_err(|e| err("registering memory", e))?;
        let remote = RemoteMr { addr: addr as u64, rkey: mr.rkey(), len: region.len() };
        let lkey = mr.lkey();
        self.mrs().insert(region.id(), region.key(), lkey, remote, mr);
        Ok(remote)
    }

    /// Withdraws a region's registration.
    pub fn deregister(&self, id: RegionId) {
        drop(self.mrs().remove(id));
    }

    /// A peer's lookup of a region: the registration, if `key` is right.
    pub fn resolve(&self, id: RegionId, key: RemoteKey) -> Result<RemoteMr, Status> {
        self.mrs().resolve(id, key)
    }
}

type Pending = HashMap<u64, (Done, u64, Region)>;

/// An RC queue pair to one peer, with its completion thread.
pub struct RcQp {
    peer: NodeId,
    device: Arc<Device>,
    qp: Mutex<BasicQueuePair>,
    local: ConnInfo,
    pending: Arc<Mutex<Pending>>,
    next: AtomicU64,
    stop: Arc<AtomicBool>,
    poller: Option<JoinHandle<()>>,
}

impl RcQp {
    /// Creates a queue pair in INIT state.
    pub fn create(device: &Arc<Device>, peer: NodeId) -> Result<RcQp> {
        let mut cqb = device.ctx.create_cq_builder();
        cqb.setup_cqe(MAX_SEND_WR * 2);
        let cq = cqb.build().map_err(|e| err("creating a completion queue", e))?;
        let mut b = device.pd.create_qp_builder();
        b.setup_max_send_wr(MAX_SEND_WR)
            .setup_max_recv_wr(1)
            .setup_max_send_sge(1)
            .setup_send_cq(cq.clone())
            .setup_recv_cq(cq.clone());
        let mut qp = b.build().map_err(|e| err("creating a queue pair", e))?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(PORT)
            .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead);
        qp.modify(&attr).map_err(|e| err("moving the queue pair to INIT", e))?;
        let mut psn = [0u8; 4];
        getrandom::fill(&mut psn).map_err(|e| err("drawing a PSN", e))?;
        let local = ConnInfo {
            qp_num: qp.qp_number(),
            psn: u32::from_le_bytes(psn) & 0x00ff_ffff,
            lid: device.lid,
            port: PORT,
            gid_index: device.gid_index,
            gid: device.gid,
        };
        let pending: Arc<Mutex<Pending>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let poller = {
            let (pending, stop) = (pending.clone(), stop.clone());
            std::thread::Builder::new()
                .name(format!("cascade-cq-{peer}"))
                .spawn(move || poll_loop(peer, cq, pending, stop))
                .map_err(|e| TransportError::io("starting the completion thread", e))?
        };
        Ok(RcQp {
            peer,
            device: device.clone(),
            qp: Mutex::new(qp),
            local,
            pending,
            next: AtomicU64::new(1),
            stop,
            poller: Some(poller),
        })
    }

    /// What the peer needs to connect to this queue pair.
    pub fn local_info(&self) -> ConnInfo {
        self.local
    }

    /// Brings the queue pair to RTR then RTS against the peer's information.
    pub fn connect(&self, remote: &ConnInfo) -> Result<()> {
        let mut qp = self.qp.lock().unwrap_or_else(|e| e.into_inner());
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(Mtu::Mtu1024)
            .setup_dest_qp_num(remote.qp_num)
            .setup_rq_psn(remote.psn)
            .setup_max_dest_read_atomic(16)
            .setup_min_rnr_timer(12);
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(remote.lid)
            .setup_port(remote.port)
            .setup_service_level(0)
            .setup_grh_src_gid_index(self.local.gid_index)
            .setup_grh_dest_gid(&sideway::ibverbs::address::Gid { raw: remote.gid })
            .setup_grh_hop_limit(64);
        attr.setup_address_vector(&ah);
        qp.modify(&attr).map_err(|e| err("moving the queue pair to RTR", e))?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(self.local.psn)
            .setup_timeout(14)
            .setup_retry_cnt(7)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(16);
        qp.modify(&attr).map_err(|e| err("moving the queue pair to RTS", e))
    }

    /// Posts a one-sided WRITE of `len` bytes from `local[local_offset..]` to `remote[remote_offset..]`.
    pub fn post_write(
        &self,
        local: &Region,
        local_offset: u64,
        remote: RemoteMr,
        remote_offset: u64,
        len: u64,
    ) -> OpHandle {
        self.post(true, local, local_offset, remote, remote_offset, len)
    }

    /// Posts a one-sided READ of `len` bytes from `remote[remote_offset..]` into `local[local_offset..]`.
    pub fn post_read(
        &self,
        local: &Region,
        local_offset: u64,
        remote: RemoteMr,
        remote_offset: u64,
        len: u64,
    ) -> OpHandle {
        self.post(false, local, local_offset, remote, remote_offset, len)
    }

    fn post(
        &self,
        write: bool,
        local: &Region,
        local_offset: u64,
        remote: RemoteMr,
        remote_offset: u64,
        len: u64,
    ) -> OpHandle {
        let op = if write { "write" } else { "read" };
        if let Err(e) = local.check(local_offset, len) {
            return OpHandle::ready(self.peer, Err(e));
        }
        let raddr = match remote.address(remote_offset, len) {
            Ok(a) => a,
            Err(status) => {
                return OpHandle::ready(self.peer, Err(TransportError::Refused { peer: self.peer, op, status }))
            }
        };
        let Ok(len32) = u32::try_from(len) else {
            return OpHandle::ready(self.peer, Err(err(op, "a work request moves at most 4 GiB - 1")));
        };
        let lkey = match self.device.mrs().lkey(local.id()) {
            Some(k) => k,
            None => match self.device.register(local) {
                Ok(_) => self.device.mrs().lkey(local.id()).unwrap_or(0),
                Err(e) => return OpHandle::ready(self.peer, Err(e)),
            },
        };
        let (done, handle) = OpHandle::new(self.peer);
        let wr_id = self.next.fetch_add(1, Ordering::Relaxed);
        self.pending.lock().unwrap_or_else(|e| e.into_inner()).insert(wr_id, (done, len, local.clone()));
        // SAFETY: bounds-checked above; the region stays alive in `pending` until completion.
        let laddr = unsafe { local.slice(local_offset, len) }.as_ptr() as u64;
        let mut qp = self.qp.lock().unwrap_or_else(|e| e.into_inner());
        let mut guard = qp.start_post_send();
        let wr = guard.construct_wr(wr_id, WorkRequestFlags::Signaled);
        let wr = if write { wr.setup_write(remote.rkey, raddr) } else { wr.setup_read(remote.rkey, raddr) };
        // SAFETY: `laddr..laddr+len` lies in a region registered under `lkey` that is kept alive
        // (in `pending`) until the work completion is reaped.
        unsafe { wr.setup_sge(lkey, laddr, len32) };
        if let Err(e) = guard.post() {
            if let Some((done, _, _)) = self.pending.lock().unwrap_or_else(|e| e.into_inner()).remove(&wr_id) {
                let _ = done.send(Err(err("posting a work request", e)));
            }
        }
        handle
    }
}

impl Drop for RcQp {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(p) = self.poller.take() {
            let _ = p.join();
        }
    }
}

fn poll_loop(peer: NodeId, cq: Arc<BasicCompletionQueue>, pending: Arc<Mutex<Pending>>, stop: Arc<AtomicBool>) {
    let mut idle = 0u32;
    while !stop.load(Ordering::Relaxed) {
        match cq.start_poll() {
            Ok(poller) => {
                idle = 0;
                for wc in poller {
                    let entry = pending.lock().unwrap_or_else(|e| e.into_inner()).remove(&wc.wr_id());
                    if let Some((done, len, _region)) = entry {
                        let r = match wc.status() {
                            0 => Ok(Completion::moved(len)),
                            s => Err(TransportError::PeerDown {
                                peer,
                                reason: format!("RDMA work completion status {s}"),
                            }),
                        };
                        let _ = done.send(r);
                    }
                }
            }
            Err(PollCompletionQueueError::CompletionQueueEmpty) => {
                // Spin briefly for latency, then back off so an idle link costs no CPU.
                idle = idle.saturating_add(1);
                if idle > 1000 {
                    std::thread::sleep(Duration::from_micros(50));
                } else {
                    std::hint::spin_loop();
                }
            }
            Err(e) => return fail_all(&pending, || err("polling the completion queue", &e)),
        }
    }
    fail_all(&pending, || TransportError::PeerDown { peer, reason: "queue pair closed".into() });
}

/// Fails every operation still waiting for a completion.
fn fail_all(pending: &Mutex<Pending>, error: impl Fn() -> TransportError) {
    for (_, (done, _, _)) in pending.lock().unwrap_or_else(|e| e.into_inner()).drain() {
        let _ = done.send(Err(error()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::test_access as ta;

    #[test]
    fn opening_without_a_device_is_a_clear_error() {
        match Device::open(None) {
            Ok(_) => eprintln!("an RDMA device is present; the device tests cover it"),
            Err(e) => assert!(matches!(e, TransportError::NoRdmaDevice { .. }), "{e}"),
        }
        assert!(matches!(Device::open(Some("no-such-device-xyz")), Err(TransportError::NoRdmaDevice { .. })));
    }

    #[tokio::test]
    #[ignore = "requires an RDMA device"]
    async fn loopback_queue_pair_writes_and_reads() {
        let dev = Device::open(None).unwrap();
        let src = Region::alloc(1 << 20, Default::default()).unwrap();
        let dst = Region::alloc(1 << 20, Default::default()).unwrap();
        ta::fill(&src, 0, 1 << 20, 0x3c).unwrap();
        dev.register(&src).unwrap();
        let remote = dev.register(&dst).unwrap();
        assert_eq!(dev.resolve(dst.id(), dst.key()), Ok(remote));
        let (a, b) = (RcQp::create(&dev, 1).unwrap(), RcQp::create(&dev, 0).unwrap());
        a.connect(&b.local_info()).unwrap();
        b.connect(&a.local_info()).unwrap();
        a.post_write(&src, 0, remote, 0, 1 << 20).await.unwrap();
        assert_eq!(ta::crc32(&dst, 0, 1 << 20).unwrap(), ta::crc32(&src, 0, 1 << 20).unwrap());
        let back = Region::alloc(4096, Default::default()).unwrap();
        a.post_read(&back, 0, remote, 4096, 4096).await.unwrap();
        assert!(ta::view(&back, 0, 4096).unwrap().iter().all(|&x| x == 0x3c));
        let refused = a.post_write(&src, 0, remote, (1 << 20) - 1, 2).await;
        assert!(matches!(refused, Err(TransportError::Refused { status: Status::OutOfBounds, .. })));
    }
}
