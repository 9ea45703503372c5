"""What a compiled program costs and why it has each collective: estimates, reasons, dumps, metrics.

``memory`` (the peak-memory estimator) · ``allocator_model`` (the caching allocator's reserved
peak) · ``why`` (why each collective and layout change is there) · ``debug`` (dump files,
collective summaries, the simulated step) · ``metrics`` (``StepMeter``: step time, tokens/s, MFU).
The cost model (hardware profiles, compute and communication times, the timeline) is the sibling
package ``hyper_parallel.cost``. Nothing is imported here."""
