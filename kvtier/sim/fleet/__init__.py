"""Fleet replay: trace requests over simulated engine instances routed by kvtier's router code
(:mod:`.fleet`), the engine and tier model (:mod:`.engine`), and Dynamo's replay side by side
(:mod:`.dynamo`)."""
