"""Standard-library scripts the checks run on the nodes with the node's python.

They are sent as source over the SSH channel (``python -c SOURCE CONFIG``) and print
one JSON document; nothing is installed or left on the node.
"""
