"""kvpilot as Envoy's endpoint picker: Envoy carries every stream, kvpilot only decides.

- ``contract`` (pure): the header names and access-log attributes Envoy's config and the
  picker agree on;
- ``picker``: the router's decision and bookkeeping for a request Envoy carries;
- ``extproc``: Envoy's ext_proc gRPC protocol over the picker;
- ``access_log``: Envoy's OpenTelemetry access log (each request's end) into the picker;
- ``service``: the gRPC server holding both, beside the router's HTTP front.
"""
