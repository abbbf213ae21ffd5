//! Lossless compression of KV blocks on slow links.
//!
//! A stream of raw bytes (a transfer's data, in order) travels as frames of at most
//! [`frame::CHUNK`] raw bytes each. A frame splits its chunk's 16-bit values into two planes
//! ([`planes`]): for bf16 the 8-bit exponents and the sign-and-mantissa bytes, for other
//! 16-bit types the high and the low bytes. The exponent plane of real KV holds a few
//! distinct values and entropy-codes to a fraction of its size (zstd); the mantissa plane is
//! close to random and is stored as it is unless coding it pays. Every frame carries the
//! CRC-32 of its raw bytes: a corrupt or truncated frame is a typed [`frame::FrameError`],
//! never wrong data.
//!
//! [`policy`] decides per transfer whether frames make the handoff faster: the link rate
//! against what the codec achieves on this host and this data (compress rate x ratio).

pub mod codec;
pub mod frame;
pub mod planes;
pub mod policy;
