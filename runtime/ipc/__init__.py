"""Process plumbing shared by the engine core and worker processes: the msgspec codec of the
records that cross sockets (never pickle), ZMQ sends that never block, and the parent
lifeline that ends a child when its parent is gone."""
