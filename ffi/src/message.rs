//! The application service: what [`crate::cascade_send`] sends and [`crate::cascade_recv`]
//! receives, on the control plane's service [`ServiceId::APP`].

use cascade_transport::service::ServiceId;

/// One application message: the sender's tag and its bytes.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct AppMessage {
    pub(crate) tag: u64,
    pub(crate) data: Vec<u8>,
}

cascade_transport::binary_message!(AppMessage, ServiceId::APP, 1);
