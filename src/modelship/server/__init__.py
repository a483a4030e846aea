"""modelship.server"""
