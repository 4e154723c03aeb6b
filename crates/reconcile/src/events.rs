//! The one way the operator's controllers publish Kubernetes Events: one reporter (`egress-operator`, with the pod's
//! name as its instance when `POD_NAME` is set), one failure log, one recorder per Event.

use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Client, Resource};
use tracing::warn;

use crate::decide::EventSpec;

/// Publishes Events about the operator's objects; cheap to clone.
#[derive(Clone)]
pub(crate) struct Events {
    client: Client,
    reporter: Reporter,
}

impl Events {
    /// Events reported as `egress-operator`, from this pod.
    pub(crate) fn new(client: Client) -> Self {
        let reporter = Reporter { controller: "egress-operator".into(), instance: std::env::var("POD_NAME").ok() };
        Self { client, reporter }
    }

    /// Publishes `event` about `object`, as part of `action` (`Reconcile`, `CollectOrphans`). A failure is logged
    /// and otherwise ignored: an Event is a courtesy, never a reason to fail the work it describes.
    pub(crate) async fn publish<K: Resource<DynamicType = ()>>(&self, object: &K, event: &EventSpec, action: &str) {
        let kube_event = Event {
            type_: if event.warning { EventType::Warning } else { EventType::Normal },
            reason: event.reason.to_owned(),
            note: Some(event.note.clone()),
            action: action.to_owned(),
            secondary: None,
        };
        // A recorder per Event: kube's Recorder scans its whole cache of past Events on every publish (O(n) in the
        // fleet) and keeps each for minutes only to aggregate repeats, which the controllers do not make (an Event
        // follows a transition).
        let recorder = Recorder::new(self.client.clone(), self.reporter.clone());
        if let Err(error) = recorder.publish(&kube_event, &object.object_ref(&())).await {
            warn!(%error, reason = event.reason, "publishing an Event failed");
        }
    }
}
