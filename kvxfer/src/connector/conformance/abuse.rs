//! Cases where a consumer abuses the lease: declarations it has no right to, and more
//! requests held at once than its share. The real load still succeeds and frees on its
//! acknowledgement; the abuser's calls fail typed and change nothing.

use std::thread;
use std::time::{Duration, Instant};

use super::cache::{HEADS, LAYERS};
use super::harness::{
    cfg, failed_naming, freed_as, ok, setup, Harness, Verdict, ALL, LAYERS_ALL, T,
};
use crate::connector::api::LoadSpec;
use crate::connector::config::ConnectorConfig;
use kvxfer_proto::lifecycle::{FreeReason, MAX_READERS};
use kvxfer_proto::wire::connector::Grant;

/// Another consumer declares readers before the real one reads: two with an edited grant,
/// then a million and the limit plus one with the true one. Both are refused and change nothing: the real load
/// succeeds and its acknowledgement frees the blocks (before: the first declaration won, and
/// the real load failed or the blocks stayed held for 999,999 more readers).
pub fn squatted_declarations(h: &dyn Harness) -> Verdict {
    let s = setup(h, cfg(), vec![(HEADS, cfg()), (HEADS, cfg())])?;
    let (p, real, squat) = (&s.producer, &s.consumers[0], &s.consumers[1]);
    let remote = [5, 6, 7];
    let hd = ok(p.publish("squat", &remote, 12, LAYERS as usize), "publish")?;
    let million = LoadSpec {
        heads: None,
        readers: Some(1_000_000),
    };
    // Within the limit: only the grant check refuses it.
    let two = LoadSpec {
        heads: None,
        readers: Some(2),
    };
    let mut edited = hd.clone();
    edited.grant = Some(Grant([0x5a; 16]));
    for (what, handoff, spec) in [
        ("an edited grant", &edited, &two),
        ("more readers than any request has", &hd, &million),
        (
            "one reader past the limit",
            &hd,
            &LoadSpec {
                heads: None,
                readers: Some(MAX_READERS as u32 + 1),
            },
        ),
    ] {
        let r = squat
            .start_load_with(handoff, &[20, 21, 22], spec)
            .and_then(|()| squat.wait("squat", T));
        ensure!(r.is_err(), "a load declaring {what} succeeded");
        ensure!(
            squat.in_progress() == 0,
            "the refused load is still in progress"
        );
        while squat.next_failed().is_some() {}
    }
    ensure!(p.held() == 1, "the squat changed the hold: {}", p.held());
    let local = [0, 1, 2];
    ok(real.start_load(&hd, &local), "the real start_load")?;
    ok(real.wait("squat", T), "the real load")?;
    s.dst[0].holds(&local, &s.src, &remote, ALL, LAYERS_ALL)?;
    freed_as(&**p, "squat", FreeReason::Acked, T)
}

/// One consumer may be reading at most its share of requests at once: past it, its next
/// load is refused typed, fails alone naming its blocks, and shows in the producer's
/// metrics; once its loads end, it gets its share back.
pub fn peer_share(h: &dyn Harness) -> Verdict {
    let pc = ConnectorConfig {
        lease: Duration::from_millis(800),
        ..cfg()
    }
    .peer_share(2, None);
    let s = setup(h, pc, vec![(HEADS, cfg())])?;
    let (p, c) = (&s.producer, &s.consumers[0]);
    // No layer computed: the loads wait, heartbeating, and keep their requests held.
    let hds = ["a", "b", "c"].map(|r| p.publish(r, &[1, 2], 8, 0));
    let [a, b, third] = hds.map(|h| h.map_err(|e| format!("publish: {e}")));
    let (a, b, third) = (a?, b?, third?);
    ok(c.start_load(&a, &[10, 11]), "start_load a")?;
    ok(c.start_load(&b, &[12, 13]), "start_load b")?;
    wait_until("the consumer to hold two requests", || {
        p.telemetry()
            .peers_held()
            .first()
            .is_some_and(|(_, h)| h.requests == 2)
    })?;
    ok(c.start_load(&third, &[14, 15]), "start_load c")?;
    let r = c.wait("c", T);
    ensure!(r.is_err(), "a load past the consumer's share succeeded");
    failed_naming(&**c, &[14, 15])?;
    ensure!(
        p.telemetry().shares_refused() >= 1,
        "the refusal is not in the producer's metrics"
    );
    let text = p.telemetry().prometheus();
    ensure!(
        text.contains("kvxfer_peer_requests_held{role=\"producer\"") && text.contains("} 2\n"),
        "the metrics do not show the two requests held: {text}"
    );
    // The two held loads complete; their acknowledgements give the share back.
    for r in ["a", "b"] {
        for l in 0..LAYERS as usize {
            ok(p.layer_done(r, l), "layer_done")?;
        }
    }
    ok(c.wait("a", T), "load a")?;
    ok(c.wait("b", T), "load b")?;
    freed_as(&**p, "a", FreeReason::Acked, T)?;
    freed_as(&**p, "b", FreeReason::Acked, T)?;
    let d = ok(p.publish("d", &[3, 4], 8, LAYERS as usize), "publish d")?;
    ok(c.start_load(&d, &[16, 17]), "start_load d")?;
    ok(c.wait("d", T), "load d, after the share came back")?;
    freed_as(&**p, "d", FreeReason::Acked, T)?;
    wait_until("the producer's metrics to show nothing held", || {
        p.telemetry().peers_held().is_empty()
    })
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) -> Verdict {
    let deadline = Instant::now() + T;
    while !done() {
        ensure!(Instant::now() < deadline, "timed out waiting for {what}");
        thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}
