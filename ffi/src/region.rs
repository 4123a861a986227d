//! Memory regions: register the caller's memory (or allocate the library's), describe them to
//! peers, deregister.

use std::time::{Duration, Instant};

use cascade_transport::{Region, RegionId, RemoteKey, RemoteRegion};

use crate::buf;
use crate::endpoint::cascade_endpoint;
use crate::error::{guard, FfiError, FfiResult, CASCADE_ERR_BUSY, CASCADE_OK};

/// What a peer needs to address a region: exchange it out of band (or by
/// [`crate::cascade_send`]) and name it in a [`crate::cascade_op`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct cascade_remote_region {
    /// The node that owns the region.
    pub node: u32,
    /// Its id on that node.
    pub id: u32,
    /// The key a peer must present.
    pub key: u64,
    /// Its length in bytes.
    pub len: u64,
}

impl From<cascade_remote_region> for RemoteRegion {
    fn from(r: cascade_remote_region) -> RemoteRegion {
        RemoteRegion { node: r.node, id: RegionId(r.id), key: RemoteKey(r.key), len: r.len }
    }
}

/// A registered region (opaque).
pub struct cascade_region {
    pub(crate) region: Region,
    pub(crate) node: u32,
    /// The endpoint it was registered with: deregistering it through another one withdraws
    /// nothing there, and would otherwise wait out its timeout as "busy" again and again.
    pub(crate) owner: std::sync::Weak<cascade_transport::Endpoint>,
}

impl cascade_region {
    /// The handle of `region`, registered with `ep`, for the caller to own.
    pub(crate) fn hand_out(ep: &cascade_endpoint, region: Region) -> *mut cascade_region {
        let owner = std::sync::Arc::downgrade(&ep.ep);
        Box::into_raw(Box::new(cascade_region { region, node: ep.ep.node(), owner }))
    }
}

/// Checks a region handle.
///
/// # Safety
/// `p` is null or a live region handle.
pub(crate) unsafe fn region<'a>(p: *const cascade_region) -> FfiResult<&'a cascade_region> {
    // SAFETY: forwarded contract.
    unsafe { buf::handle(p, "region") }
}

fn hand_out(ep: &cascade_endpoint, r: Region, out: buf::Out<*mut cascade_region>) -> FfiResult<i32> {
    ep.ep.register(&r)?;
    out.put(cascade_region::hand_out(ep, r));
    Ok(CASCADE_OK)
}

/// Registers `len` bytes at `addr`, memory the caller owns, so that peers may READ and WRITE it.
///
/// **DMA-lifetime rule**: the memory must stay valid — not freed, unmapped or reused — from this
/// call until [`cascade_region_deregister`] has returned [`CASCADE_OK`] for it. Until then peers
/// may write into it at any time the application lets them (as with RDMA-registered memory):
/// reading bytes a peer is writing gives unspecified values, and coordinating that (a completion,
/// a message after it) is the application's job. The library never frees this memory.
///
/// # Safety
/// `ep` is a live endpoint; `addr` is valid for reads and writes of `len` bytes under the rule
/// above; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn cascade_region_register(
    ep: *const cascade_endpoint,
    addr: *mut u8,
    len: u64,
    out: *mut *mut cascade_region,
) -> i32 {
    guard("cascade_region_register", || {
        // SAFETY: the caller's contract.
        let (e, out) = unsafe { (buf::handle(ep, "ep")?, buf::out_param(out, "out")?) };
        // SAFETY: the caller lends `len` bytes at `addr` under the DMA-lifetime rule, which
        // deregistration enforces on our side (it waits until no operation or peer holds it).
        let r = unsafe { Region::from_raw(addr, len) }?;
        hand_out(e, r, out)
    })
}

/// Allocates a zeroed region of `len` bytes owned by the library (shared memory when the
/// endpoint uses it, so same-host peers reach it by one copy) and registers it; its address is
/// [`cascade_region_ptr`].
///
/// # Safety
/// `ep` is a live endpoint; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn cascade_region_alloc(
    ep: *const cascade_endpoint,
    len: u64,
    out: *mut *mut cascade_region,
) -> i32 {
    guard("cascade_region_alloc", || {
        // SAFETY: the caller's contract.
        let (e, out) = unsafe { (buf::handle(ep, "ep")?, buf::out_param(out, "out")?) };
        let r = e.ep.alloc(len)?;
        hand_out(e, r, out)
    })
}

/// The address of the region's first byte (for a registered region, the caller's `addr`),
/// valid until the region is deregistered; the same concurrency rule applies.
///
/// # Safety
/// `region` is a live region; `addr` is writable.
#[no_mangle]
pub unsafe extern "C" fn cascade_region_ptr(region: *const cascade_region, addr: *mut *mut u8) -> i32 {
    guard("cascade_region_ptr", || {
        // SAFETY: the caller's contract.
        let (r, addr) = unsafe { (self::region(region)?, buf::out_param(addr, "addr")?) };
        addr.put(r.region.as_mut_ptr());
        Ok(CASCADE_OK)
    })
}

/// The descriptor peers use to address the region, in `*out`.
///
/// # Safety
/// `region` is a live region; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn cascade_region_descriptor(
    region: *const cascade_region,
    out: *mut cascade_remote_region,
) -> i32 {
    guard("cascade_region_descriptor", || {
        // SAFETY: the caller's contract.
        let (r, out) = unsafe { (self::region(region)?, buf::out_param(out, "out")?) };
        let d = r.region.remote(r.node);
        out.put(cascade_remote_region { node: d.node, id: d.id.0, key: d.key.0, len: d.len });
        Ok(CASCADE_OK)
    })
}

/// Withdraws the region from peers (their new accesses are refused) and waits at most
/// `timeout_ms` until nothing holds it any more — no operation of this endpoint in flight on it
/// and no peer access under way. Then it frees the handle and returns [`CASCADE_OK`]: registered
/// memory is the caller's again. If something still holds it at the deadline, returns
/// [`CASCADE_ERR_BUSY`] and the handle stays valid (withdrawn): call again. A region of
/// another endpoint is refused with `CASCADE_ERR_INVALID_ARGUMENT` and left as it was.
///
/// # Safety
/// `ep` is the endpoint the region was registered with; `region` is a live region, not used
/// again after [`CASCADE_OK`].
#[no_mangle]
pub unsafe extern "C" fn cascade_region_deregister(
    ep: *const cascade_endpoint,
    region: *mut cascade_region,
    timeout_ms: u32,
) -> i32 {
    guard("cascade_region_deregister", || {
        // SAFETY: the caller's contract.
        let (e, r) = unsafe { (buf::handle(ep, "ep")?, self::region(region)?) };
        if !std::ptr::eq(r.owner.as_ptr(), std::sync::Arc::as_ptr(&e.ep)) {
            return Err(FfiError::arg(format!(
                "region {} was registered with another endpoint (node {}): deregister it there",
                r.region.id(),
                r.node
            )));
        }
        drop(e.ep.deregister(r.region.id()));
        let deadline = Instant::now() + Duration::from_millis(timeout_ms.into());
        while !r.region.is_unique() {
            if Instant::now() >= deadline {
                return Err(FfiError::new(
                    CASCADE_ERR_BUSY,
                    format!("region {} is still used by operations in flight; call again", r.region.id()),
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        // SAFETY: made by `Box::into_raw` in `hand_out`; the caller gives the handle up.
        drop(unsafe { Box::from_raw(region) });
        Ok(CASCADE_OK)
    })
}
