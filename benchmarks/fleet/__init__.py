"""Fleet benchmarks on Dynamo mocker fleets: traces, arms, replay, the floor, results and goodput
(``bench_fleet.py``)."""
