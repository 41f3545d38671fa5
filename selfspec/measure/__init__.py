"""Everything that measures: methods against plain decoding, and what explains the figures.

- `passes`: one method against its baseline (`measure_row`, `compare_with_plain`);
- `grid`, `sweep`: the grid of methods x draft lengths x samplings, and a sweep over it;
- `lossless`: greedy speculative output against plain greedy, with near-tie gaps;
- `divergence`: where two greedy outputs part, and whether at a near-tie of the dtype;
- `costs`: c(N) of a target; `floor`: the loop's floor and ceiling (the oracle);
- `autosize`: a draft length chosen by calibration; `replay`: greedy tau without timing;
- `peers`: our decoder and Hugging Face's; `memory`: peak memory on any device;
- `results`, `plots`: JSON/CSV, tables and figures; `oracle`: the drafter that knows the answer.

Nothing below this package imports it: drafters, heads and the decode loop are measured, they
do not measure.
"""
