"""kvpilot's Grafana dashboards as code: :mod:`kvpilot.grafana.panels` says what every panel
shows (plain data), :mod:`kvpilot.grafana.generate` builds the committed JSON from it with
Grafana's foundation SDK (a dev dependency; the package imports as
``grafana_foundation_sdk``, so this ``grafana`` package does not shadow it)."""
