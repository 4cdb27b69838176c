//! Wake on packet, the kernel side: a sleeping VM's tap as the agent reaches it
//! ([`TapPort`]: its carrier notifications and a packet socket to send held frames to the
//! guest), and the frame logic ([`frame`]: the flow a frame belongs to, the checksum a held
//! frame needs before it is sent again).

pub mod frame;
mod port;

pub use port::TapPort;
