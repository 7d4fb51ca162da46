// Search from file:// without a server or a CDN.
//
// Material runs its search in a Web Worker, and browsers refuse to start a Worker from a
// file:// page. On such pages this script (loaded before material's bundle, as a polyfill)
// replaces `Worker` with a stand-in that runs the worker script in a hidden iframe of the same
// page, giving it what material's search worker uses: a global `postMessage`, "message"
// events, and an awaitable `importScripts`. Over http(s) it does nothing.
(function () {
  "use strict";
  if (location.protocol !== "file:") return;

  // Load one classic script into `doc`; resolves when it has run.
  function loadScript(doc, src) {
    return new Promise(function (resolve, reject) {
      var script = doc.createElement("script");
      script.src = src;
      script.onload = resolve;
      script.onerror = function () { reject(new Error("cannot load worker script " + src)); };
      doc.head.appendChild(script);
    });
  }

  class IframeWorker extends EventTarget {
    constructor(url) {
      super();
      var worker = this;
      var src = new URL(url, location.href).href;
      this.frame = document.createElement("iframe");
      this.frame.hidden = true;
      (document.body || document.documentElement).appendChild(this.frame);
      var scope = this.frame.contentWindow;  // about:blank: same origin as this page

      // The worker's side: what it posts arrives here as a "message" event.
      scope.postMessage = function (data) { worker.emit(new MessageEvent("message", { data: data })); };
      scope.importScripts = function () {
        var urls = Array.prototype.map.call(arguments, function (u) { return new URL(u, src).href; });
        return urls.reduce(function (done, u) {
          return done.then(function () { return loadScript(scope.document, u); });
        }, Promise.resolve());
      };
      this.ready = loadScript(scope.document, src);
      this.ready.catch(function (err) {
        console.error(err.message);
        worker.emit(new ErrorEvent("error", { message: err.message }));
      });
    }

    emit(event) {
      var handler = this["on" + event.type];
      if (typeof handler === "function") handler.call(this, event);
      this.dispatchEvent(event);
    }

    // The page's side: messages wait until the worker script has run.
    postMessage(data) {
      var scope = this.frame.contentWindow;
      this.ready.then(function () { scope.dispatchEvent(new scope.MessageEvent("message", { data: data })); });
    }

    terminate() {
      this.frame.remove();
    }
  }

  window.Worker = IframeWorker;
})();
