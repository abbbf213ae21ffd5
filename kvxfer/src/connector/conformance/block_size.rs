//! Heterogeneous block sizes (`kvxfer_proto::block_size`): a producer of 4-token blocks and a
//! consumer of 8 (and the reverse), NHD, with a prefix the consumer holds already; every token
//! of the request checked where it landed, pulled by the consumer and pushed by the producer.
//! HND, where one size does not map onto the other, is refused naming both sizes.

use super::cache::TestCache;
use super::harness::{cfg, freed_as, ok, Connectors, Harness, Verdict, T};
use crate::connector::api::{KvConsumer, KvProducer};
use crate::connector::config::ConnectorConfig;
use kvxfer_proto::descriptor::Desc;
use kvxfer_proto::layout::{KvOrder, KvPacking};
use kvxfer_proto::lifecycle::FreeReason;
use kvxfer_proto::wire::connector::Mode;

/// A producer and a consumer of other block sizes; fields drop in order.
struct Sides {
    producer: Box<dyn KvProducer>,
    consumer: Box<dyn KvConsumer>,
    _connectors: Connectors,
    src: TestCache,
    dst: TestCache,
}

fn sides(h: &dyn Harness, order: KvOrder, p: u64, c: u64, mode: Mode) -> Result<Sides, String> {
    let cache = |bt, seed| {
        ok(
            TestCache::laid_out(KvPacking::Fused, order, 2, 8, bt, seed),
            "cache",
        )
    };
    let (src, dst) = (cache(p, Some(61))?, cache(c, None)?);
    let conns = ok(h.connectors(1, 1), "connectors")?;
    let cf = ConnectorConfig { mode, ..cfg() };
    let producer = ok(conns.producers[0].producer(src.caches(), &cf), "producer")?;
    let consumer = ok(conns.consumers[0].consumer(dst.caches(), &cf), "consumer")?;
    Ok(Sides {
        producer,
        consumer,
        _connectors: conns,
        src,
        dst,
    })
}

/// Prefill blocks of 4 tokens into decode blocks of 8: an 18-token prompt is 5 producer blocks
/// and 3 consumer blocks, the first of which the consumer holds; the second takes two producer
/// blocks, the last (half full) one, token for token.
pub fn block_sizes_small_to_large(h: &dyn Harness) -> Verdict {
    block_size_case(h, 4, 8, &[3, 9, 4, 7, 5], &[6, 2], Mode::Pull)
}

/// Prefill blocks of 8 tokens into decode blocks of 4: 3 producer blocks, 5 consumer blocks,
/// the first two held already; the others take halves of the producer's.
pub fn block_sizes_large_to_small(h: &dyn Harness) -> Verdict {
    block_size_case(h, 8, 4, &[3, 9, 4], &[2, 11, 0], Mode::Pull)
}

/// [`block_sizes_small_to_large`] written by the producer (push): the consumer names its
/// blocks in the producer's smaller size, and only those are opened to it.
pub fn block_sizes_small_to_large_pushed(h: &dyn Harness) -> Verdict {
    block_size_case(h, 4, 8, &[3, 9, 4, 7, 5], &[6, 2], Mode::Push)
}

/// [`block_sizes_large_to_small`] written by the producer (push): it splits its own blocks
/// in the consumer's smaller size.
pub fn block_sizes_large_to_small_pushed(h: &dyn Harness) -> Verdict {
    block_size_case(h, 8, 4, &[3, 9, 4], &[2, 11, 0], Mode::Push)
}

fn block_size_case(
    h: &dyn Harness,
    p: u64,
    c: u64,
    remote: &[u32],
    local: &[u32],
    mode: Mode,
) -> Verdict {
    const TOKENS: u64 = 18;
    let s = sides(h, KvOrder::Nhd, p, c, mode)?;
    let layers = s.src.view().layers.len();
    let hd = ok(s.producer.publish("bs", remote, TOKENS, layers), "publish")?;
    ok(s.consumer.start_load(&hd, local), "start_load")?;
    ok(s.consumer.wait("bs", T), "wait")?;
    // Token by token, written out from the two block sizes alone: token t of the request is
    // at t % p of producer block remote[t / p], and lands at t % c of the consumer's block for
    // t / c (its list is the request's last blocks; the ones before are its cached prefix).
    let (sv, dv) = (s.src.view(), s.dst.view());
    let tok = sv.block_bytes() / p;
    let first = TOKENS.div_ceil(c) - local.len() as u64;
    let (mut mine, mut theirs) = (Vec::new(), Vec::new());
    for layer in 0..layers {
        for t in first * c..TOKENS {
            let lb = u64::from(local[(t / c - first) as usize]);
            let rb = u64::from(remote[(t / p) as usize]);
            let (dr, doff) = dv.layers[layer].k;
            let (sr, soff) = sv.layers[layer].k;
            mine.push(Desc::new(
                dr,
                doff + lb * dv.block_bytes() + (t % c) * tok,
                tok,
            ));
            theirs.push(Desc::new(
                sr,
                soff + rb * sv.block_bytes() + (t % p) * tok,
                tok,
            ));
        }
    }
    s.dst.same_bytes(&mine, &s.src, &theirs)?;
    // Nothing outside the loaded blocks was written.
    let others: Vec<u32> = (0..16).filter(|b| !local.contains(b)).collect();
    ensure!(
        s.dst.zeroed(&others, 0..layers),
        "blocks outside the load were written"
    );
    let st = s
        .consumer
        .next_finished()
        .ok_or("the load is not reported")?;
    // Whole blocks of the smaller size, up to the last token's.
    let small = p.min(c);
    let moved = (TOKENS.div_ceil(small) - first * c / small) * small * tok * layers as u64;
    ensure!(
        st.bytes_moved == moved,
        "moved {}, want {moved}",
        st.bytes_moved
    );
    freed_as(&*s.producer, "bs", FreeReason::Acked, T)
}

/// Where one size does not map onto the other (HND), the load is refused naming both sizes,
/// pulled or pushed; nothing moves.
pub fn block_sizes_that_cannot_map_are_refused(h: &dyn Harness) -> Verdict {
    for mode in [Mode::Pull, Mode::Push] {
        let s = sides(h, KvOrder::Hnd, 4, 8, mode)?;
        let hd = ok(s.producer.publish("hnd", &[1, 2, 3, 4], 16, 0), "publish")?;
        let e = s.consumer.start_load(&hd, &[5, 6]);
        ensure!(
            e.as_ref().is_err_and(|e| {
                let t = e.to_string();
                t.contains("4-token blocks on the producer, 8-token blocks here")
                    && t.contains("HND")
            }),
            "HND of two block sizes, {mode:?}: {e:?}"
        );
        ensure!(
            s.dst.zeroed(&[5, 6], 0..4),
            "a refused {mode:?} load wrote blocks"
        );
    }
    Ok(())
}
