//! The `starling` binary's subcommands that name a process's role
//! (argv[1]): the daemons, and the hidden entry points a starling process
//! re-executes the binary as. The CLI dispatches on these, the crates that
//! start them use them, and `starling down` recognises a cluster's
//! processes by them.

pub const HEAD: &str = "head";
pub const AGENT: &str = "agent";
/// A task's sandbox init (`starling-sandbox`), started by the agent.
pub const SANDBOX_INIT: &str = "__sandbox-init";
/// An emulated host's boot (`starling-cluster`), started by `starling up`.
pub const HOST_BOOT: &str = "__host-boot";
/// The emulated WAN link's relay (`starling-link`), started by `starling up --link`.
pub const LINK: &str = "__link";

/// Every role a process of an embedded cluster has.
pub const CLUSTER_ROLES: [&str; 5] = [AGENT, HOST_BOOT, HEAD, SANDBOX_INIT, LINK];
