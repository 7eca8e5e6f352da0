"""Kubernetes manifests for the P/D fleet, the router and the dashboards, generated from
the same plan as the CPU fleet (:func:`kvpilot.deploy.fleet_spec.plan_fleet`).

:mod:`.plan` turns a :class:`.plan.ClusterSpec` into per-engine and router plans;
:mod:`.workloads`, :mod:`.network`, :mod:`.observability` and :mod:`.dynamo` turn plans
into objects; :mod:`.render` writes them to ``deploy/k8s/manifests/`` (``kvpilot k8s
render``). See docs/guides/kubernetes.md.
"""
