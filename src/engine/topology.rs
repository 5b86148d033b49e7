//! Which ranks share a node, and the exchange that follows from it.
//!
//! Nodes of G GPUs share one network link. The flat exchange sends every rank's codes to every
//! rank, so each node pushes about G compressed buckets through its link per step. The
//! two-level exchange sends each bucket in three parts:
//!
//! ```text
//!  node 0: ranks 0 1 | node 1: ranks 2 3        bucket = [shard 0 | shard 1] (G shards)
//!  1. reduce-scatter inside each node (plain, the bucket's dtype): rank 0 holds node 0's sum
//!     of shard 0, rank 1 of shard 1, rank 2 node 1's of shard 0, ...
//!  2. the compressed exchange of each shard along its rail (the ranks with the same local
//!     index on every node: ranks 0 and 2 for shard 0, ranks 1 and 3 for shard 1), with error
//!     feedback on the shard
//!  3. all-gather of the decoded shards inside each node
//! ```
//!
//! so only the rails cross nodes, each carrying 1/G of the bucket: about G times fewer bytes
//! leave a node than with the flat exchange, and each rank compresses 1/G of the bucket.

use crate::error::{Error, Result};

/// How a compressed all-reduce moves between nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Topology {
    /// Two-level where there are at least 2 nodes of equal size, each of at least 2 ranks;
    /// flat otherwise (with one log line when the nodes differ in size).
    #[default]
    Auto,
    /// Every rank exchanges with every rank.
    Flat,
    /// Plain inside the node, compressed between nodes; an error for nodes of different sizes.
    /// With one node, or one rank per node, it is the flat exchange (there is no other level).
    TwoLevel,
}

impl Topology {
    /// The name options and messages use.
    pub fn name(self) -> &'static str {
        match self {
            Topology::Auto => "auto",
            Topology::Flat => "flat",
            Topology::TwoLevel => "two-level",
        }
    }

    /// Its code in the agreement round and in checkpoints.
    pub fn code(self) -> u8 {
        match self {
            Topology::Auto => 0,
            Topology::Flat => 1,
            Topology::TwoLevel => 2,
        }
    }

    /// The topology of a name.
    ///
    /// # Errors
    /// [`Error::Transport`] for a name that is none of `auto`, `flat`, `two-level`.
    pub fn from_name(name: &str) -> Result<Topology> {
        match name {
            "auto" => Ok(Topology::Auto),
            "flat" => Ok(Topology::Flat),
            "two-level" => Ok(Topology::TwoLevel),
            other => Err(Error::Transport(format!(
                "topology must be 'auto', 'flat' or 'two-level', not {other:?}"
            ))),
        }
    }
}

/// Node indices (0, 1, ... in order of first appearance) from each rank's node name.
pub fn node_indices<S: AsRef<str>>(names: &[S]) -> Vec<usize> {
    let mut seen: Vec<&str> = Vec::new();
    names
        .iter()
        .map(|n| {
            let n = n.as_ref();
            match seen.iter().position(|s| *s == n) {
                Some(i) => i,
                None => {
                    seen.push(n);
                    seen.len() - 1
                }
            }
        })
        .collect()
}

/// A hash of a node map, for the agreement round (ranks that see different nodes would build
/// different groups).
pub(crate) fn nodes_word(nodes: &[usize]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &n in nodes {
        for b in (n as u64).to_le_bytes() {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// This rank's place in a two-level exchange.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Levels {
    /// The ranks of this rank's node, in rank order (this rank is `node[local]`).
    pub node: Vec<usize>,
    /// The ranks of this rank's rail (local index `local` on every node), in node order.
    pub rail: Vec<usize>,
    /// This rank's node (its index, in order of first appearance).
    pub node_index: usize,
    /// This rank's index within its node.
    pub local: usize,
}

impl Levels {
    /// Ranks per node.
    pub fn per_node(&self) -> usize {
        self.node.len()
    }

    /// Nodes.
    pub fn nodes(&self) -> usize {
        self.rail.len()
    }
}

/// The two-level plan for `rank` under `topology`, given each rank's node index (`nodes`, one
/// per rank; empty: one node): `None` for the flat exchange.
///
/// # Errors
/// [`Error::Transport`] for `nodes` of the wrong length, a rank outside it, or `TwoLevel` over
/// nodes of different sizes.
pub fn plan(topology: Topology, nodes: &[usize], rank: usize) -> Result<Option<Levels>> {
    if nodes.is_empty() || topology == Topology::Flat {
        return Ok(None);
    }
    if rank >= nodes.len() {
        return Err(Error::Transport(format!(
            "rank {rank} has no node in a map of {} ranks",
            nodes.len()
        )));
    }
    let count = nodes.iter().copied().max().unwrap_or(0) + 1;
    let mut members: Vec<Vec<usize>> = vec![Vec::new(); count];
    for (r, &n) in nodes.iter().enumerate() {
        members[n].push(r);
    }
    members.retain(|m| !m.is_empty());
    let sizes: Vec<usize> = members.iter().map(Vec::len).collect();
    let even = sizes.iter().all(|&s| s == sizes[0]);
    if !even {
        let detail = format!(
            "the {} nodes hold {:?} ranks: a two-level exchange needs nodes of one size",
            sizes.len(),
            sizes
        );
        if topology == Topology::TwoLevel {
            return Err(Error::Transport(format!(
                "topology='two-level' cannot run: {detail} (use 'flat', or 'auto', which \
                 falls back to flat)"
            )));
        }
        if rank == 0 {
            tracing::warn!("cfc: {detail}; exchanging flat");
        }
        return Ok(None);
    }
    if members.len() < 2 || sizes[0] < 2 {
        // One node, or one rank per node: the flat exchange is the only level there is.
        return Ok(None);
    }
    let node_index = members.iter().position(|m| m.contains(&rank)).unwrap_or(0);
    let node = members[node_index].clone();
    let local = node.iter().position(|&r| r == rank).unwrap_or(0);
    let rail = members.iter().map(|m| m[local]).collect();
    Ok(Some(Levels {
        node,
        rail,
        node_index,
        local,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_by_name_in_order_of_appearance() {
        assert_eq!(
            node_indices(&["b", "b", "a", "a", "c"]),
            vec![0, 0, 1, 1, 2]
        );
    }

    #[test]
    fn two_nodes_of_two_make_rails_across_them() {
        // ranks 0 and 2 on node "x", 1 and 3 on node "y" (interleaved, as a launcher may do)
        let nodes = node_indices(&["x", "y", "x", "y"]);
        let l = plan(Topology::Auto, &nodes, 2).unwrap().unwrap();
        assert_eq!(l.node, vec![0, 2]);
        assert_eq!(l.local, 1);
        assert_eq!(l.rail, vec![2, 3]);
        assert_eq!((l.per_node(), l.nodes()), (2, 2));
        let l = plan(Topology::TwoLevel, &nodes, 1).unwrap().unwrap();
        assert_eq!(
            (l.node.clone(), l.rail.clone(), l.local),
            (vec![1, 3], vec![0, 1], 0)
        );
    }

    #[test]
    fn flat_where_there_is_one_level() {
        for t in [Topology::Auto, Topology::TwoLevel] {
            assert_eq!(plan(t, &[0, 0, 0, 0], 1).unwrap(), None, "one node");
            assert_eq!(plan(t, &[0, 1, 2], 1).unwrap(), None, "one rank per node");
            assert_eq!(plan(t, &[], 0).unwrap(), None, "no map");
        }
        assert_eq!(plan(Topology::Flat, &[0, 0, 1, 1], 0).unwrap(), None);
    }

    #[test]
    fn nodes_of_different_sizes() {
        let nodes = [0, 0, 0, 1, 1];
        assert_eq!(plan(Topology::Auto, &nodes, 0).unwrap(), None);
        let e = plan(Topology::TwoLevel, &nodes, 0).unwrap_err().to_string();
        assert!(e.contains("[3, 2]") && e.contains("'flat'"), "{e}");
        assert!(plan(Topology::Auto, &nodes, 7).is_err());
        assert!(Topology::from_name("ring").is_err());
        assert_eq!(
            Topology::from_name("two-level").unwrap(),
            Topology::TwoLevel
        );
    }
}
