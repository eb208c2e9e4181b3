"""Alert automations: notify on failed, skipped and regressed eval points (docs/alerts.md).

`ensure_alerts(block)` creates (or replaces, by name) one automation per outcome event —
`pinned-eval-alert-failed`, `-skipped`, `-regressed` — each a reactive event trigger on
`pinned-eval.point.*` resources with a `send-notification` action through the saved Prefect
notification block named `block` (any type with the `notify` capability: Slack, custom webhook,
email, ...). Without such a block it creates nothing and says so. `pinned-eval deploy` runs it
(`python -m app.automations`, with the stack's environment) for the block `ALERTS_BLOCK`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from uuid import UUID

from prefect import get_client
from prefect.automations import AutomationCore, EventTrigger, Posture, SendNotification

from pinned_eval.events import EVENT_FAILED, EVENT_REGRESSED, EVENT_SKIPPED, POINT_RESOURCE_PREFIX

ALERTS_BLOCK = "pinned-eval-alerts"
ALERT_EVENTS = {"failed": EVENT_FAILED, "skipped": EVENT_SKIPPED, "regressed": EVENT_REGRESSED}
AUTOMATION_PREFIX = "pinned-eval-alert-"
_SUBJECT = "pinned-eval: {{ event.resource['prefect.resource.name'] }} %s"
_BODY = (
    "{{ event.event }} at {{ event.occurred }}\n"
    "run {{ event.resource['pinned-eval.run'] }}, step {{ event.resource['pinned-eval.step'] }}, "
    "dataset {{ event.resource['pinned-eval.dataset'] or '-' }}\n"
    "{{ event.payload | tojson }}"
)


def alert_automations(block_document_id: UUID) -> list[AutomationCore]:
    """The three automations, notifying through the block document `block_document_id`."""
    return [
        AutomationCore(
            name=f"{AUTOMATION_PREFIX}{kind}",
            description=f"Notify when an eval point is {kind} ({event}).",
            enabled=True,
            trigger=EventTrigger(
                match={"prefect.resource.id": f"{POINT_RESOURCE_PREFIX}*"},
                expect={event},
                posture=Posture.Reactive,
                threshold=1,
                within=timedelta(0),
            ),
            actions=[SendNotification(block_document_id=block_document_id, subject=_SUBJECT % kind, body=_BODY)],
        )
        for kind, event in ALERT_EVENTS.items()
    ]


def notification_block_id(block: str) -> UUID | None:
    """The id of the saved block named `block` that can notify; None when there is none."""
    with get_client(sync_client=True) as client:
        resp = client.request(
            "POST",
            "/block_documents/filter",
            json={
                "block_documents": {"name": {"any_": [block]}, "is_anonymous": {"eq_": False}},
                "block_schemas": {"block_capabilities": {"all_": ["notify"]}},
                "include_secrets": False,
            },
        )
    docs = resp.json()
    if len(docs) > 1:
        raise ValueError(f"--block: {len(docs)} notification blocks are named {block!r}; rename all but one")
    return UUID(docs[0]["id"]) if docs else None


def ensure_alerts(block: str = ALERTS_BLOCK) -> list[UUID]:
    """Create or replace the alert automations for `block`; [] (and nothing created) without it."""
    block_id = notification_block_id(block)
    if block_id is None:
        return []
    ids = []
    with get_client(sync_client=True) as client:
        for automation in alert_automations(block_id):
            for old in client.read_automations_by_name(automation.name):
                client.delete_automation(old.id)
            ids.append(client.create_automation(automation))
    return ids


def ensure_alerts_in(env: dict[str, str], block: str = ALERTS_BLOCK) -> str:
    """`ensure_alerts` in a subprocess with the stack's environment (what `deploy` calls); its report line."""
    out = subprocess.run(
        [sys.executable, "-m", "app.automations", "--block", block],
        env=env, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120,
    )
    if out.returncode != 0:
        raise RuntimeError(f"alert automations failed:\n{out.stdout}\n{out.stderr}")
    return out.stdout.strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Create the pinned-eval alert automations.")
    parser.add_argument("--block", default=ALERTS_BLOCK, help="name of a saved Prefect notification block")
    args = parser.parse_args(argv)
    ids = ensure_alerts(args.block)
    if ids:
        print(f"alerts: {len(ids)} automations notify through block {args.block!r}")
    else:
        print(f"alerts off: no notification block named {args.block!r} (save one, then deploy again)")


if __name__ == "__main__":
    main()
