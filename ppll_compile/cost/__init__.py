"""Cost: a captured graph in, the FLOPs, bytes and seconds of every node out, without running the model.

Takes: a graph from :mod:`..capture` and the hardware a plan is for.
Gives: per-node FLOPs, parameters and saved activations on fake tensors (:mod:`.nodes`, :mod:`.flops`,
:mod:`.oplog`), a module's cost (:mod:`.modules`, an auxiliary head's), seconds on a device's roofline
(:mod:`.roofline`, a device's figures (:mod:`.figures`) measured by :mod:`.calibration` or read from
:mod:`.hardware`'s presets), optimizer state (:mod:`.optimizers`), costs re-priced in a precision or with fused chains
(:mod:`.reprice`, :mod:`.autocast`)."""
