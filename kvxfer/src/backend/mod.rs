//! Transport backends. UCX is the only one; it is the only code that does transport I/O.
pub(crate) mod ucx;
