//! The kube `Controller` over ProxyPools: observe the members → [`decide_pool`] → act → status.
//!
//! A pool owns its members by an owner reference with `controller: true` and labels them with its name; it never
//! touches a Proxy it does not own, even one carrying its label. Member names are `<pool>-<ordinal>`, the lowest free
//! ordinals, so a create repeated after a crash meets the object the first one made (409) instead of making a second.
//! Because the store may not yet show the controller's own last writes, each pass records what it expects to see
//! (a member present, gone, or changed) and the next pass acts only once the store shows it, or after
//! [`EXPECTATION_TIMEOUT`]: a stale read never doubles a create or a delete. A restarted operator starts from a fresh
//! list, which needs no expectations.
//!
//! Deleting a pool deletes its members through the owner references (the cluster's garbage collector); each
//! member's own finalizer then deletes its instance. The pool needs no finalizer of its own.

use std::future::Future;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use kube::ResourceExt;
use kube::runtime::controller::{Action, Config as RuntimeConfig, Controller};
use tracing::{Instrument, debug, info_span, instrument, warn};

use super::index::pool_of;
use crate::Error;
use crate::feed::{Change, GuardedPool, PoolFeed, ProxyFeed};
use crate::ids::pool_id;

mod act;
mod context;
mod slots;
mod status;

use act::apply;
pub use act::ordinal_of;
use context::{CONCURRENCY, EXPECTATION_RECHECK};
pub use context::{
    EXPECTATION_TIMEOUT, NoSignals, POOL_FIELD_MANAGER, PoolContext, PoolSignals, PoolTrigger,
    TEMPLATE_LABELS_ANNOTATION,
};

/// Runs the pool controller until `shutdown` resolves; in-flight reconciles finish first.
///
/// Pools are woken by their own changes, by changes to the Proxies labelled for them (through a [`MemberIndex`]
/// kept from the Proxy feed), and by `wakes` (the discovery API's demand).
pub async fn run_pools(
    context: Arc<PoolContext>,
    pools: PoolFeed,
    proxies: ProxyFeed,
    wakes: impl Stream<Item = PoolTrigger> + Send + 'static,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let shutdown = futures::FutureExt::shared(shutdown);
    let ready = tokio::select! {
        ready = async { pools.ready().await && proxies.ready().await } => ready,
        () = shutdown.clone() => return,
    };
    if !ready {
        warn!("the ProxyPool or Proxy watch ended before its first list; the pool controller does not start");
        return;
    }
    let (member_sender, member_triggers) = tokio::sync::mpsc::unbounded_channel::<PoolTrigger>();
    let index = context.index.clone();
    let store = proxies.store();
    let changes = proxies.subscribe();
    let indexer = tokio::spawn(
        async move {
            futures::pin_mut!(changes);
            while let Some(change) = changes.next().await {
                let touched = {
                    let mut index = index.lock().expect("member index");
                    match change {
                        Change::Object(reference) => {
                            let pool = store.get(&reference).and_then(|object| pool_of(&object));
                            index.set(&reference, pool)
                        }
                        Change::Resync => {
                            let all = store.state();
                            index.rebuild(all.iter().map(AsRef::as_ref));
                            index.pools()
                        }
                    }
                };
                for pool in touched {
                    if member_sender.send(pool).is_err() {
                        return;
                    }
                }
            }
        }
        .instrument(info_span!("pool_member_index")),
    );
    let pool_store = pools.store();
    let pool_changes = pools.subscribe().flat_map(move |change| {
        let objects = match change {
            Change::Object(reference) => pool_store.get(&reference).into_iter().collect(),
            Change::Resync => pool_store.state(),
        };
        futures::stream::iter(objects)
    });
    let member_triggers = futures::stream::unfold(member_triggers, |mut receiver| async move {
        receiver.recv().await.map(|item| (item, receiver))
    });
    Controller::for_shared_stream(pool_changes, pools.store())
        .with_config(RuntimeConfig::default().concurrency(CONCURRENCY))
        .reconcile_on(futures::stream::select(member_triggers, wakes))
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, context)
        .for_each(|result| async move {
            if let Err(error) = result {
                debug!(%error, "pool controller event");
            }
        })
        .instrument(info_span!("pool_controller"))
        .await;
    indexer.abort();
}

fn error_policy(object: Arc<GuardedPool>, error: &Error, context: Arc<PoolContext>) -> Action {
    let key = pool_id(object.as_ref());
    let failures = context.with_memory(&key, |memory| {
        memory.failures = memory.failures.saturating_add(1);
        memory.failures
    });
    let backoff = crate::backoff::RECONCILE_ERRORS.after(failures);
    context.metrics.reconciled(false);
    warn!(pool = %key, kind = error.kind(), %error, failures, backoff_secs = backoff.as_secs(), "pool reconcile failed");
    Action::requeue(backoff)
}

#[instrument(skip(object, context), fields(pool = %object.name_any(), namespace = object.namespace().unwrap_or_default()))]
async fn reconcile(object: Arc<GuardedPool>, context: Arc<PoolContext>) -> Result<Action, Error> {
    let pool = match &object.0 {
        Ok(pool) => pool,
        Err(invalid) => {
            warn!(error = %invalid.error, "skipping a ProxyPool that cannot be read");
            return Ok(Action::await_change());
        }
    };
    let namespace = pool.namespace().unwrap_or_default();
    let key = pool_id(pool);
    if pool.metadata.deletion_timestamp.is_some() {
        // The garbage collector deletes the members through their owner references.
        context.metrics.forget(&key);
        context.memory.lock().expect("pool memory").remove(&key);
        return Ok(Action::await_change());
    }
    if !context.expectations_met(&key, &namespace) || !context.shows_last_scale(&key, pool) {
        return Ok(Action::requeue(EXPECTATION_RECHECK));
    }
    let next = apply(pool, &key, &namespace, &context).await?;
    context.with_memory(&key, |memory| memory.failures = 0);
    context.metrics.reconciled(true);
    Ok(Action::requeue(next))
}
