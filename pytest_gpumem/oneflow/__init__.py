"""OneFlow-only code: the nn.Graph boxing audit, and the rendezvous that keeps ranks out of OneFlow's
10 s reconnect sleep. ``import oneflow`` inside it is the framework (absolute imports)."""
