"""A virtual-time fleet simulator: engines modelled as Dynamo 1.6.1's mocker models them
(:mod:`benchmarks.sim.engine`), fed Mooncake traces and routed per request (:mod:`benchmarks.sim.fleet`)."""
