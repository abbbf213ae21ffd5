//! What a consumer checks and plans before it loads a handoff: per cache group, the heads it
//! reads into which of its own, the producer's layout, and the blocks paired. Pure decisions
//! over the shell's configuration (the checks themselves are [`check_load`]'s).
#![forbid(unsafe_code)]

use kvxfer_proto::block_size::{producer_block_tokens, resize};
use kvxfer_proto::connector::check_load;
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::groups::{held, pair_blocks, CacheGroups};
use kvxfer_proto::layout::{KvLayout, KvPacking};
use kvxfer_proto::state::units_of;
use kvxfer_proto::tp::HeadMap;
use kvxfer_proto::wire::connector::{Handoff, Mode};

use super::api::LoadSpec;
use super::config::ConnectorConfig;

/// One cache group's part of a load.
#[derive(Debug)]
pub(crate) struct GroupLoad {
    /// The producer's layout of the group, as the handoff describes it.
    pub(crate) remote: KvLayout,
    /// The producer's heads read, and the local heads they land in.
    pub(crate) heads: HeadMap,
    /// Local blocks written, paired index by index with `theirs`.
    pub(crate) local: Vec<u32>,
    /// The producer's blocks read.
    pub(crate) theirs: Vec<u32>,
    /// Bytes of the producer's blocks this consumer holds already (a cached prefix), every
    /// head: not moved.
    pub(crate) cached_bytes: u64,
    /// The consumer's cache in the producer's smaller blocks, where the two block sizes
    /// differ ([`kvxfer_proto::block_size`]); `local` and `theirs` count in those.
    pub(crate) view: Option<KvLayout>,
    /// The consumer's blocks as a push producer pairs them from the end of its own: as
    /// given, or in the view's size.
    pub(crate) want: Vec<u32>,
}

/// What both consumers check before a load of `h` into `local_blocks` of `local`: the heads
/// `spec` asks for (else `cfg`'s, into every local head) against both caches
/// ([`check_load`]), and no head slice in push mode. The producer's layout and the heads.
pub(crate) fn load_plan(
    local: &KvLayout,
    cfg: &ConnectorConfig,
    spec: &LoadSpec,
    h: &Handoff,
    local_blocks: &[u32],
) -> Result<(KvLayout, HeadMap)> {
    let lh = local.geometry.kv_heads;
    let map = asked_heads(cfg, spec, lh);
    let remote = check_load(local, map.as_ref(), h, local_blocks)?;
    let map = map.unwrap_or(HeadMap::all(h.kv_heads));
    if h.mode == Mode::Push && map != HeadMap::all(lh) {
        return Err(Error::InvalidArgument(format!(
            "load {:?}: heads {:?} into {:?} need pull mode (a push producer writes whole \
             blocks)",
            h.request, map.remote, map.local
        )));
    }
    Ok((remote, map))
}

/// The heads a load asks for: `spec`'s, else the config's into every one of the `local` heads;
/// `None`: every head into every head.
fn asked_heads(cfg: &ConnectorConfig, spec: &LoadSpec, local: u64) -> Option<HeadMap> {
    spec.heads.clone().or_else(|| {
        cfg.heads.clone().map(|remote| HeadMap {
            remote,
            local: 0..local,
        })
    })
}

/// [`load_plan`] for every cache group of `groups`: `local_blocks[g]` into group `g`, paired
/// with the handoff's blocks of that group ([`pair_blocks`]). A latent (MLA) group holds no
/// heads: it is read whole wherever `spec` moves anything. An error names the group when
/// there are several.
pub(crate) fn plan_groups(
    groups: &CacheGroups,
    cfg: &ConnectorConfig,
    spec: &LoadSpec,
    h: &Handoff,
    local_blocks: &[&[u32]],
) -> Result<Vec<GroupLoad>> {
    if h.group_count() != groups.len() || local_blocks.len() != groups.len() {
        return Err(Error::Handoff {
            request: h.request.clone(),
            why: format!(
                "the producer's cache has {} group(s), this consumer's {}, and block lists of \
                 {} were given",
                h.group_count(),
                groups.len(),
                local_blocks.len()
            ),
        });
    }
    let named = |g: usize, e: Error| -> Error {
        if groups.len() == 1 {
            return e;
        }
        match e {
            Error::Handoff { request, why } => Error::Handoff {
                request,
                why: format!("group {g}: {why}"),
            },
            Error::InvalidArgument(w) => Error::InvalidArgument(format!("group {g}: {w}")),
            e => e,
        }
    };
    let mut out = Vec::with_capacity(groups.len());
    for (g, (layout, &mine)) in groups.layouts().iter().zip(local_blocks).enumerate() {
        let Some(mut hg) = h.of_group(g) else {
            return Err(named(g, Error::InvalidArgument("no such group".into())));
        };
        // Another block size on the producer: both sides in blocks of the smaller one.
        let (mut mine, mut view, mut cached) = (mine.to_vec(), None, None);
        let bt = producer_block_tokens(layout, hg.kv_heads, hg.compat);
        if let Some(bt) = bt.filter(|&bt| bt != layout.block_tokens) {
            let r =
                resize(layout, bt, h.tokens, &mine, &hg.blocks, hg.num_blocks).map_err(|why| {
                    named(
                        g,
                        Error::Handoff {
                            request: h.request.clone(),
                            why,
                        },
                    )
                })?;
            // The producer's cache read as blocks of the smaller size hashes as this view.
            let mut theirs = r.local.clone();
            theirs.geometry.kv_heads = hg.kv_heads;
            hg.compat = theirs.compat_hash();
            (hg.blocks, hg.num_blocks, mine) =
                (r.remote_blocks, r.remote_num_blocks, r.local_blocks);
            (view, cached) = (Some(r.local), Some(r.remote_cached));
        }
        let layout = view.as_ref().unwrap_or(layout);
        let want = mine.clone();
        let mine = &mine[..];
        let (local, theirs) = pair_blocks(mine, &hg.blocks).map_err(|why| {
            named(
                g,
                Error::InvalidArgument(format!("load {:?}: {why}", h.request)),
            )
        })?;
        let latent = LoadSpec {
            heads: Some(match &spec.heads {
                Some(m) if m.width() == 0 => m.clone(),
                _ => HeadMap::all(1),
            }),
            readers: spec.readers,
        };
        let state = match layout.packing {
            KvPacking::State => Some(state_spec(groups, cfg, spec, h, g, &hg, layout)?),
            _ => None,
        };
        let spec = match layout.packing {
            KvPacking::Latent => &latent,
            KvPacking::State => state.as_ref().unwrap_or(spec),
            _ => spec,
        };
        let (remote, heads) = load_plan(layout, cfg, spec, &hg, &local).map_err(|e| named(g, e))?;
        // The producer's held blocks before the ones paired (the consumer's cached prefix).
        let cached = cached
            .unwrap_or_else(|| held(&hg.blocks[..hg.blocks.len() - mine.len()]).count() as u64);
        out.push(GroupLoad {
            remote,
            heads,
            local,
            theirs,
            cached_bytes: cached * layout.block_bytes_all_layers(),
            view,
            want,
        });
    }
    Ok(out)
}

/// The load of state group `g` (`hg` of `h`, `layout` here): the same fraction of each
/// rank's split units as the heads `spec` (else `cfg`) gives in the reference group, the first
/// of heads (attention; the state group itself in a model of state alone). Refused, naming the group and both
/// sides' units, where the fraction is not whole units: a page that does not split that way.
fn state_spec(
    groups: &CacheGroups,
    cfg: &ConnectorConfig,
    spec: &LoadSpec,
    h: &Handoff,
    g: usize,
    hg: &Handoff,
    layout: &KvLayout,
) -> Result<LoadSpec> {
    // The reference: the first group of heads (attention); a model of state alone, its units.
    let r = groups
        .layouts()
        .iter()
        .position(|l| !matches!(l.packing, KvPacking::State | KvPacking::Latent))
        .unwrap_or(g);
    let ref_remote = match r {
        0 => h.kv_heads,
        r => h.groups.get(r - 1).map_or(hg.kv_heads, |x| x.kv_heads),
    };
    let ref_local = groups.layouts()[r].geometry.kv_heads;
    let map = asked_heads(cfg, spec, ref_local);
    let units = match map {
        None if hg.kv_heads == layout.geometry.kv_heads => None,
        Some(m) if m.width() == 0 => Some(m),
        map => {
            let m = map.unwrap_or(HeadMap::all(ref_remote));
            let got = units_of(
                &m,
                ref_remote,
                ref_local,
                hg.kv_heads,
                layout.geometry.kv_heads,
            );
            Some(got.ok_or_else(|| Error::Handoff {
                request: h.request.clone(),
                why: format!(
                    "group {g}: state pages of {} split units on the producer and {} here do \
                     not split as heads {:?} of {ref_remote} into {:?} of {ref_local} (another \
                     TP size needs a page described by its units)",
                    hg.kv_heads, layout.geometry.kv_heads, m.remote, m.local
                ),
            })?)
        }
    };
    Ok(LoadSpec {
        heads: units,
        readers: spec.readers,
    })
}
