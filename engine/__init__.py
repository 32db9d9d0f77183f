"""specloop.engine"""
