"""Discrete-event simulation of a swarm, driven by the planner's placement and routing and the shared PerfModel.

Read in this order: engine (the loop) -> session (a request's events) -> simulator (shared state, run) ->
scenario (topology + planner -> simulation). Inputs: arrivals, generators, graphml. Outputs: metrics, plots.
See docs/SIMULATOR.md.
"""
