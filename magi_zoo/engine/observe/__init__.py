"""What the engine observes and reports, apart from the steps that act:

- `counters`: dynamo's global compile counters, snapshots and deltas (the test oracle);
- `accounting`: each compiled region's exclusive share of those counters (`tracked`);
- `report`: `Report`, what `apply` returns -- the steps taken and the regions' live counters;
- `explain`: one call with torch's structured compile trace captured, written as a folder;
- `table`: `format_table`, the plain table they all print with;
- `progress`: `stage` names the phase a run is in, `Heartbeat` prints a line when the output
  has been quiet too long (a long build, compile or generation stage).

Import the modules themselves (`from magi_zoo.engine.observe.report import Report`): this
`__init__` imports none of them, so the resolver can use `table` without loading `report`,
which holds a resolved plan.
"""
