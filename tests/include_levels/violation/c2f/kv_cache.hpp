// The cache the violating plumbing header includes.
#pragma once
