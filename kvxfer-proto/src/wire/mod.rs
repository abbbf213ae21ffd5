//! Every wire format kvxfer speaks, each with a paired encoder and decoder, named sizes and
//! round-trip tests: agent metadata, notifications, the TCP lane, the side channel. The
//! connector's decision logic over its messages is in [`crate::connector`].

pub mod connector;
pub mod lane;
pub mod metadata;
pub mod notify;
pub mod side_channel;
