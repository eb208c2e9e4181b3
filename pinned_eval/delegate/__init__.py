"""miles' `eval.delegate`: outside evaluators (NeMo-Skills) run against the point's gateway.

`config` reads the entries and builds miles' request; `client` posts it and maps the reply's
`raw_metrics` to miles' metric names; `gateway` puts the gateway's token in the `router_url`;
`run` runs a point's delegates (docs/harnesses.md). This package imports no Prefect.
"""

from pinned_eval.delegate.config import DelegateSpec, parse_delegates, request_body

__all__ = ["DelegateSpec", "parse_delegates", "request_body"]
